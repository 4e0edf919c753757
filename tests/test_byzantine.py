"""Byzantine devices as recipe faults: each lie does what it says, the server bounds claimed example
counts, and robust rules' parameters are checked against the devices a round has.
benchmarks/byzantine.py measures every attack against every rule (docs/federation.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from flwr.app import Context, RecordDict
from test_strategy import TINY

from ondevice_moe.errors import UserError
from ondevice_moe.federation.faults import flips_labels, lie
from ondevice_moe.federation.job import Job
from ondevice_moe.recipe import FaultSection, load_recipe, validate_recipe
from ondevice_moe.run_folder import RunFolder
from ondevice_moe.server_rules.aggregation import MEDIAN_BOUND, Update, bounded_counts

BYZANTINE = Path(__file__).resolve().parents[1] / "recipes" / "byzantine-digits.yaml"


def _context() -> Context:
    return Context(run_id=1, node_id=1, state=RecordDict(), run_config={}, node_config={"partition-id": 0})


def _lie(kind: str, sent: dict, received: dict, context: Context | None = None, server_round: int = 1, **options):
    job = Job(load_recipe(BYZANTINE), 0, Path("."))
    return lie(FaultSection(device=0, kind=kind, **options), sent, received, context or _context(), job, 0,
               server_round)


def test_each_lie_rewrites_the_upload_as_its_fault_says():
    received = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor([3])}
    sent = {"w": torch.tensor([1.5, 1.0]), "n": torch.tensor([3])}
    flipped = _lie("sign-flip", sent, received, scale=4.0)
    assert torch.equal(flipped["w"], torch.tensor([1.0 - 4 * 0.5, 2.0 + 4 * 1.0])) and torch.equal(flipped["n"],
                                                                                                   sent["n"])
    assert torch.equal(_lie("sign-flip", sent, {})["w"], -sent["w"])  # nothing received yet: the model negated
    assert torch.equal(_lie("constant", sent, received, value=7.0)["w"], torch.full((2,), 7.0))
    noisy = _lie("noise", sent, received, std=0.5)["w"]
    assert not torch.equal(noisy, sent["w"]) and torch.equal(noisy, _lie("noise", sent, received, std=0.5)["w"])
    context = _context()
    first = _lie("stale", sent, received, context)
    later = _lie("stale", {"w": torch.tensor([9.0, 9.0]), "n": torch.tensor([3])}, received, context, 5)
    assert torch.equal(first["w"], sent["w"]) and torch.equal(later["w"], sent["w"])  # replayed, round after round


def test_a_claimed_count_weighs_at_most_what_the_device_holds_or_twice_the_rounds_median():
    updates = [Update(device, {}, count) for device, count in enumerate([40, 60, 50, 10**9])]
    held, capped = bounded_counts(updates, {0: 40, 1: 60, 2: 55, 3: 45})
    assert [u.num_examples for u in held] == [40, 60, 50, 45] and capped == {3: 10**9}  # honest claims unchanged
    unknown, capped = bounded_counts(updates, None)
    median = (50 + 60) / 2
    assert unknown[3].num_examples == int(MEDIAN_BOUND * median) and capped == {3: 10**9}
    assert [u.num_examples for u in unknown[:3]] == [40, 60, 50]


def test_label_flip_needs_a_classification_task_and_flips_only_in_its_rounds():
    raw = yaml.safe_load(TINY.read_text())
    raw["federation"]["faults"] = [{"device": 0, "kind": "label-flip"}]
    with pytest.raises(UserError, match=r"label-flip fault .* flips a classification task.s classes"):
        validate_recipe(raw)
    faults = [FaultSection(device=1, kind="label-flip", rounds=[2])]
    assert flips_labels(faults, 1, 2) and not flips_labels(faults, 1, 1) and not flips_labels(faults, 0, 2)


@pytest.mark.parametrize(("federation", "problem"), [
    ({"aggregation": "krum", "byzantine": 18}, "krum with byzantine: 18 needs at least 21 devices a round"),
    ({"aggregation": "trimmed-mean", "trim_fraction": 0.2, "clients_per_round": 4},
     "trims nothing from a round of 4 devices"),
])
def test_a_robust_rule_that_cannot_work_with_the_rounds_devices_is_refused(federation, problem):
    raw = yaml.safe_load(BYZANTINE.read_text())
    raw["federation"].update(federation)
    with pytest.raises(UserError, match=problem):
        validate_recipe(raw)


def test_a_lying_device_is_bounded_and_flagged_in_a_real_round(tmp_path, monkeypatch):
    """Two of twenty digits clients claim a billion examples: the server counts each at what its data
    holds, says so in the train record, and the round's global is that of the honest weighting."""
    from test_strategy import InProcessGrid

    from ondevice_moe.federation import server_app
    from ondevice_moe.federation.job import JOB_ENV
    from ondevice_moe.report import MetricsLog

    raw = yaml.safe_load(BYZANTINE.read_text())
    raw["federation"].update(rounds=1, local_epochs=1, eval_every=1,
                             faults=[{"device": d, "kind": "inflated-count"} for d in (0, 1)])
    recipe = validate_recipe(raw)
    job = Job(recipe, 0, RunFolder(recipe, tmp_path / "run").prepare())
    monkeypatch.setenv(JOB_ENV, str(job.to_file(tmp_path / "job.json")))
    log = MetricsLog(job.run_dir / "metrics.jsonl")
    server_app.run_federation(InProcessGrid(20), job, log)
    from ondevice_moe.federation.device import training_sizes

    train = {r["user"]: r for r in log.read() if r["kind"] == "train"}
    sizes = training_sizes(job)
    users = recipe.user_names
    assert train[users[0]]["num-examples"] == 10**9 and train[users[0]]["examples_counted"] == sizes[0]
    assert all("examples_counted" not in train[users[d]] for d in range(2, 20))
