"""The server strategy with the real ClientApp (fault mod included), served in-process.

``InProcessGrid`` hands each message to ``client_app.app`` in this process, as
Flower's engines do in a worker, so these tests exercise sampling, dropped
devices, ``min_clients`` and ``eval_every`` in seconds, without Ray. The Ray
path is covered by tests/test_federation.py and tests/test_resume.py.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from ondevice_moe.federation import client_app, server_app
from ondevice_moe.federation.handshake import FederationFailure, connect
from ondevice_moe.federation.job import JOB_ENV, Job
from ondevice_moe.federation.strategy import sample_devices
from ondevice_moe.recipe import validate_recipe
from ondevice_moe.report import MetricsLog
from ondevice_moe.run_folder import RunFolder
from ondevice_moe.server_rules.aggregation import Update, check_update

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


class InProcessGrid(Grid):
    """Nodes whose ClientApp runs in this process; a raising device gets an error reply."""

    def __init__(self, devices: int) -> None:
        if TaskIdentity._run_id is None:  # set by Flower's engines in a real ServerApp process
            TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
        self.contexts = {1000 + 7 * d: Context(run_id=1, node_id=1000 + 7 * d, state=RecordDict(), run_config={},
                                               node_config={"partition-id": d, "num-partitions": devices})
                         for d in range(devices)}
        self.sent: list[Message] = []

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for message in messages:
            self.sent.append(message)
            try:
                replies.append(client_app.app(message, self.contexts[message.metadata.dst_node_id]))
            except Exception as error:
                replies.append(Message(Error(0, f"Traceback ...\n{type(error).__name__}: {error}"), reply_to=message))
        return replies

    def set_run(self, run_id):
        raise NotImplementedError

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError


def four_user_recipe(**federation):
    raw = yaml.safe_load(TINY.read_text())
    raw["data"]["users"].append({"name": "more-code", "source": "python-code"})
    raw["data"]["max_eval_blocks"] = 4
    raw["methods"] = ["fedavg"]
    raw["federation"].update({"local_iterations": 1, **federation})
    return validate_recipe(raw)


def federate(recipe, run_dir: Path, monkeypatch) -> list[dict]:
    """Run the recipe's only method through the strategy; returns metrics.jsonl records."""
    job = Job(recipe, 0, RunFolder(recipe, run_dir).prepare())
    monkeypatch.setenv(JOB_ENV, str(job.to_file(run_dir / ".job.json").resolve()))
    server_app.run_federation(InProcessGrid(len(recipe.user_names)), job, MetricsLog(run_dir / "metrics.jsonl"))
    return MetricsLog(run_dir / "metrics.jsonl").read()


FAULTS = [{"device": 1, "kind": "crash"}, {"device": 3, "kind": "nan"}]


def test_crashing_and_nan_devices_are_dropped_and_reported(tmp_path, monkeypatch):
    recipe = four_user_recipe(faults=FAULTS, min_clients=2)
    records = federate(recipe, tmp_path, monkeypatch)
    drops = [r for r in records if r["kind"] == "drop"]
    assert {(r["round"], r["device"]) for r in drops} == {(1, 1), (1, 3), (2, 1), (2, 3)}
    assert all("simulated crash of device 1" in r["reason"] and not r["reason"].endswith("'>")
               for r in drops if r["device"] == 1)
    assert all("non-finite" in r["reason"] for r in drops if r["device"] == 3)
    trained = {(r["round"], r["user"]) for r in records if r["kind"] == "train"}
    assert trained == {(k, u) for k in (1, 2) for u in ("code", "reviews")}
    comm = [r for r in records if r["kind"] == "comm"]
    assert [r["devices"] for r in comm] == [2, 2] and [r["dropped"] for r in comm] == [2, 2]
    assert records[-1]["kind"] == "done"
    result = RunFolder(recipe, tmp_path).report()
    fedavg = json.loads((tmp_path / "summary.json").read_text())["methods"]["fedavg"]
    assert fedavg["dropped"] == {"news": 2, "more-code": 2}
    assert set(fedavg["per_user"]) == set(recipe.user_names)  # dropped devices are still evaluated
    report = result.report.read_text()
    assert "## Dropped devices" in report and "| fedavg | news | 2 |" in report


def test_uploads_of_dropped_devices_are_not_counted(tmp_path, monkeypatch):
    clean = federate(four_user_recipe(rounds=1), tmp_path / "clean", monkeypatch)
    faulty = federate(four_user_recipe(rounds=1, faults=FAULTS), tmp_path / "faulty", monkeypatch)
    up = {name: next(r["bytes_up"] for r in records if r["kind"] == "comm")
          for name, records in (("clean", clean), ("faulty", faulty))}
    assert up["faulty"] * 2 == up["clean"] > 0


def test_too_few_sound_updates_end_the_method(tmp_path, monkeypatch):
    recipe = four_user_recipe(faults=FAULTS, min_clients=3)
    with pytest.raises(FederationFailure, match=r"round 1: 2 of 4 devices sent a sound update, fewer than "
                                                r"federation.min_clients=3 \(device 1: raised .*simulated crash"):
        federate(recipe, tmp_path, monkeypatch)
    assert "done" not in {r["kind"] for r in MetricsLog(tmp_path / "metrics.jsonl").read()}


def test_wrong_shape_in_the_first_round_is_rejected(tmp_path, monkeypatch):
    recipe = four_user_recipe(rounds=1, faults=[{"device": 2, "kind": "wrong-shape", "rounds": [1]}])
    records = federate(recipe, tmp_path, monkeypatch)
    (drop,) = [r for r in records if r["kind"] == "drop"]
    assert drop["device"] == 2 and "with shape" in drop["reason"]


def test_clients_per_round_samples_that_many_devices_reproducibly(tmp_path, monkeypatch):
    recipe = four_user_recipe(rounds=3, clients_per_round=2, eval_every=3)
    records = federate(recipe, tmp_path, monkeypatch)
    users = recipe.user_names
    for server_round in (1, 2, 3):
        trained = sorted(users.index(r["user"]) for r in records if r["kind"] == "train" and r["round"] == server_round)
        assert trained == sample_devices(4, 2, recipe.seed, server_round)
    draws = {tuple(sample_devices(4, 2, seed, k)) for seed in range(5) for k in (1, 2, 3)}
    assert len(draws) > 1 and all(len(d) == 2 for d in draws)


def test_eval_every_evaluates_every_nth_round_and_the_last(tmp_path, monkeypatch):
    recipe = four_user_recipe(rounds=3, eval_every=2)
    records = federate(recipe, tmp_path, monkeypatch)
    assert sorted({r["round"] for r in records if r["kind"] == "eval"}) == [2, 3]
    assert sorted({r["round"] for r in records if r["kind"] == "comm"}) == [1, 2, 3]
    assert not [r for r in records if r["kind"] == "drop"]  # a round without evaluation drops nobody


def test_too_few_devices_end_within_the_timeout_naming_both_numbers():
    with pytest.raises(FederationFailure, match=r"only 2 of the 3 devices the recipe needs connected within 0\.5s"):
        connect(InProcessGrid(2), 3, 0.5)


def test_oversized_and_misshaped_updates_are_rejected():
    reference = {"w": torch.empty(2, 3, device="meta")}
    sound = Update(0, {"w": torch.zeros(2, 3)}, 4)
    assert check_update(sound, reference) is None
    assert "oversized" in check_update(Update(0, {"w": torch.zeros(2, 3, dtype=torch.float64)}, 4), reference)
    assert "shape (6,)" in check_update(Update(0, {"w": torch.zeros(6)}, 4), reference)
    assert "unexpected tensors" in check_update(Update(0, {"v": torch.zeros(2, 3)}, 4), reference)


def test_one_simulation_runs_its_methods_in_turn_and_a_failing_one_does_not_stop_the_next(tmp_path, monkeypatch):
    raw = yaml.safe_load(TINY.read_text())
    raw["methods"] = ["fedavg", {"name": "comigs", "variant": "1G1S"}]
    raw["federation"].update({"local_iterations": 1, "rounds": 1})
    recipe = validate_recipe(raw)
    run_dir = RunFolder(recipe, tmp_path / "run").prepare()
    jobs = [Job(recipe, index, run_dir) for index in range(2)]
    monkeypatch.setenv(JOB_ENV, str(jobs[0].to_file(run_dir / ".jobs.json", [1, 0]).resolve()))
    grid = InProcessGrid(len(recipe.user_names))
    monkeypatch.setattr(server_app, "windowed", lambda grid, *_: grid)
    started = []
    monkeypatch.setattr(server_app, "method_hook", lambda job: started.append(job.method.name))
    real = server_app.run_federation

    def first_fails(grid, job, log, nodes):
        if job.method_index == 1:
            raise RuntimeError("a method that breaks")
        real(grid, job, log, nodes)

    monkeypatch.setattr(server_app, "run_federation", first_fails)
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    assert started == ["comigs-1G1S", "fedavg"]  # the order the job file gives
    records = MetricsLog(run_dir / "metrics.jsonl").read()
    assert [(r["method"], r["message"]) for r in records if r["kind"] == "error"] == [
        ("comigs-1G1S", "RuntimeError: a method that breaks")]
    assert MetricsLog(run_dir / "metrics.jsonl").finished() == {"fedavg"}
    assert {int(m.content["config"]["method"]) for m in grid.sent if "config" in m.content} == {0}
