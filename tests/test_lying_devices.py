"""One device of five lies; the server's checks and its robust aggregation choices hold the line.

The liar runs the real ClientApp and then tampers with its reply before it reaches the server:
a huge example count on a sign-flipped update, a magnified update, a sign flip, a dtype the
global should never take, or a packed record whose index lies about its buffer. The honest
devices' own uploads are captured on the way, so the global after the round is compared with
their mean. ``python tests/test_lying_devices.py`` prints the whole table (every aggregation
choice against every lie)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml
from flwr.app import ArrayRecord, MetricRecord

from ondevice_moe.federation import server_app
from ondevice_moe.federation.job import JOB_ENV, Job
from ondevice_moe.federation.wire import BUFFER_KEY, INDEX_KEY, pack, unpack
from ondevice_moe.recipe import validate_recipe
from ondevice_moe.report import MetricsLog
from ondevice_moe.run_folder import RunFolder

sys.path.insert(0, str(Path(__file__).parent))
from test_strategy import TINY, InProcessGrid

LIAR = 4
LIES = {
    "count": lambda tensors: {name: -3 * t for name, t in tensors.items()},  # with 10**6 examples claimed
    "magnitude": lambda tensors: {name: 50 * t for name, t in tensors.items()},
    "sign-flip": lambda tensors: {name: -t for name, t in tensors.items()},
    "dtype": lambda tensors: {name: t.to(torch.int8) for name, t in tensors.items()},
}


def forged_index(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    """The honest upload packed, its index claiming a first tensor 1,000 times its size."""
    record = pack(tensors)
    entries = json.loads(record[INDEX_KEY].numpy().tobytes())
    entries[0][2] = [1000, *entries[0][2]]
    text = json.dumps(entries).encode()
    return ArrayRecord({INDEX_KEY: torch.frombuffer(bytearray(text), dtype=torch.uint8),
                        BUFFER_KEY: torch.from_numpy(record[BUFFER_KEY].numpy())})


FORGERIES = {"forged-index": forged_index}
CHOICES = ("mean", "median", "trimmed-mean", "krum")


class LyingGrid(InProcessGrid):
    """Five honest ClientApps, one of which (``LIAR``) rewrites its training reply by ``lie``."""

    def __init__(self, devices: int, lie: str) -> None:
        super().__init__(devices)
        self.lie = lie
        self.honest: dict[int, dict[str, torch.Tensor]] = {}

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        for reply in replies:
            if reply.metadata.message_type != "train" or reply.has_error():
                continue
            device = int(self.contexts[reply.metadata.src_node_id].node_config["partition-id"])
            tensors = unpack(reply.content["arrays"])
            if device != LIAR:
                self.honest[device] = tensors
                continue
            forge = FORGERIES.get(self.lie)
            reply.content["arrays"] = forge(tensors) if forge else pack(LIES[self.lie](tensors))
            if self.lie == "count":
                metrics = dict(reply.content["metrics"])
                reply.content["metrics"] = MetricRecord({**metrics, "num-examples": 10**6})
        return replies


def lying_round(root: Path, aggregation: str, lie: str) -> tuple[float, list[int]]:
    """One FedAvg round of five devices (weighted by examples) with one liar: the distance of the
    global from the honest devices' mean, over the honest devices' own spread around it, and
    which honest devices were dropped."""
    raw = yaml.safe_load(TINY.read_text())
    raw["data"].update(clients=5, max_eval_blocks=2)
    raw["federation"].update(rounds=1, local_iterations=1, weighting="num_examples", aggregation=aggregation)
    raw["methods"] = ["fedavg"]
    recipe = validate_recipe(raw)
    job = Job(recipe, 0, RunFolder(recipe, root).prepare())
    grid = LyingGrid(5, lie)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(JOB_ENV, str(job.to_file(root / ".job.json").resolve()))
        server_app.run_federation(grid, job, MetricsLog(root / "metrics.jsonl"))
    evaluation = next(m for m in grid.sent if m.metadata.message_type == "evaluate")
    global_ = unpack(evaluation.content["arrays"])
    honest = list(grid.honest.values())
    mean = {name: torch.stack([h[name].double() for h in honest]).mean(0) for name in global_}

    def distance(tensors):
        return math.sqrt(sum(float((tensors[n].double() - mean[n]).pow(2).sum()) for n in mean))

    spread = sum(distance(h) for h in honest) / len(honest)
    dropped = sorted(r["device"] for r in MetricsLog(root / "metrics.jsonl").read() if r["kind"] == "drop")
    return distance(global_) / spread, [device for device in dropped if device != LIAR]


@pytest.mark.parametrize("lie", sorted(LIES))
@pytest.mark.parametrize("aggregation", ["median", "trimmed-mean", "krum"])
def test_robust_aggregation_keeps_the_global_near_the_honest_mean(tmp_path, aggregation, lie):
    relative, honest_dropped = lying_round(tmp_path, aggregation, lie)
    assert honest_dropped == []
    assert relative <= 1.0  # within the honest devices' own spread around their mean


def test_a_plain_mean_is_moved_by_a_liar_the_checks_do_not_catch(tmp_path):
    relative, honest_dropped = lying_round(tmp_path, "mean", "count")
    assert honest_dropped == [] and relative > 10  # why the robust choices exist


def test_a_dtype_lie_is_rejected_and_the_mean_is_the_honest_one(tmp_path):
    relative, honest_dropped = lying_round(tmp_path, "mean", "dtype")
    assert honest_dropped == [] and relative < 1e-6
    drops = [r for r in MetricsLog(tmp_path / "metrics.jsonl").read() if r["kind"] == "drop"]
    assert [r["device"] for r in drops] == [LIAR] and "torch.int8, expected torch.float32" in drops[0]["reason"]


def test_a_forged_pack_index_is_a_malformed_reply_and_the_mean_is_the_honest_one(tmp_path):
    relative, honest_dropped = lying_round(tmp_path, "mean", "forged-index")
    assert honest_dropped == [] and relative < 1e-6
    drops = [r for r in MetricsLog(tmp_path / "metrics.jsonl").read() if r["kind"] == "drop"]
    assert [r["device"] for r in drops] == [LIAR] and "malformed reply" in drops[0]["reason"]
    assert "the packed index describes" in drops[0]["reason"]


def test_robust_aggregation_is_refused_for_rules_that_are_no_plain_mean():
    raw = yaml.safe_load(TINY.read_text())
    raw["federation"]["aggregation"] = "median"
    raw["methods"] = ["fedavg", "hermes"]
    from ondevice_moe.errors import UserError

    with pytest.raises(UserError, match=r"methods \['hermes'\] do not take"):
        validate_recipe(raw)


if __name__ == "__main__":  # the closing note's table
    import tempfile

    print("| aggregation | " + " | ".join(LIES) + " |\n|---|" + "---|" * len(LIES))
    for choice in CHOICES:
        cells = []
        for lie in LIES:
            with tempfile.TemporaryDirectory() as folder:
                relative, dropped = lying_round(Path(folder), choice, lie)
            cells.append(f"{relative:.3g}" + (f" (honest dropped: {dropped})" if dropped else ""))
        print(f"| {choice} | " + " | ".join(cells) + " |")


def test_a_partial_upload_may_leave_names_out_but_never_add_one():
    from ondevice_moe.server_rules.aggregation import Update, check_update

    reference = {"experts.shared_0.lora_A": torch.empty(2, 2, device="meta"),
                 "experts.shared_1.lora_A": torch.empty(2, 2, device="meta")}
    used_one = Update(0, {"experts.shared_0.lora_A": torch.ones(2, 2)}, 4,
                      {"usage": {"experts.shared_0.lora_A": 3.0}})
    assert check_update(used_one, reference, partial=True) is None
    forged = Update(1, {**used_one.tensors, "router.weight": torch.ones(2, 2)}, 4)  # a private router's name
    assert "extra ['router.weight']" in check_update(forged, reference, partial=True)
    from ondevice_moe.methods.floral.rule import MixtureRule
    from ondevice_moe.methods.hermes.rule import InverseFrequencyRule

    for rule, records in ((InverseFrequencyRule(), {"usage": {"experts.shared_0.lora_A": -1.0}}),
                          (MixtureRule(), {"mixture": {"pi": [0.5, 0.6]}}),
                          (MixtureRule(), {"mixture": {"pi": [1.5, -0.5]}})):
        lying = Update(2, used_one.tensors, 4, records)
        assert check_update(lying, reference, partial=True) is None  # numbers in bounds, so far
        assert rule.check_records(lying) is not None  # but not what the method's rule reads them as
    for records in ({"usage": {"experts.shared_0.lora_A": float("nan")}}, {f"r{i}": {} for i in range(9)}):
        assert check_update(Update(3, used_one.tensors, 4, records), reference, partial=True) is not None
