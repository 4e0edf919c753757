"""Many clients: devices dealt over few domains, seeded sampling, the base model loaded once per
worker process, compact device state, and each round's wall time and overhead in metrics.jsonl."""

import json
from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict

from ondevice_moe import runner
from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.device_state import STATE_KEY, load_device_state, private_tensors, state_folder
from ondevice_moe.federation.job import Job
from ondevice_moe.federation.strategy import devices_per_round, sample_devices
from ondevice_moe.methods import Role
from ondevice_moe.recipe import load_recipe
from ondevice_moe.training import trainable_state

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
CLIENTS = 6
MANY = [f"data.clients={CLIENTS}", "federation.fraction_train=0.5", "federation.rounds=3",
        "federation.local_iterations=1", "federation.eval_every=3", "methods=[{name: comigs, variant: 1G1S}]"]


@pytest.fixture(scope="module")
def many_clients_run(tmp_path_factory):
    recipe = load_recipe(TINY, [*MANY, "federation.device_state=disk"])
    result = runner.run_recipe(recipe, tmp_path_factory.mktemp("run") / "many")
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return recipe, result, records


def test_clients_are_dealt_over_the_users_domains_each_with_its_own_sample():
    recipe = load_recipe(TINY, [f"data.clients={CLIENTS}"])
    assert recipe.user_names == ["code-0", "news-0", "reviews-0", "code-1", "news-1", "reviews-1"]
    assert [recipe.data.domain(k).name for k in range(CLIENTS)] == ["code", "news", "reviews"] * 2
    job = Job(recipe, 0, Path("."))
    first, again = dev.user_data(job, 0), dev.user_data(job, 3)  # two devices on python-code
    assert first.train.shape == again.train.shape and not torch.equal(first.train, again.train)
    assert len(job.method.layouts) == CLIENTS
    with pytest.raises(UserError, match="clients=2 leaves some of the 3 users' domains"):
        load_recipe(TINY, ["data.clients=2"])


def test_sampling_is_reproducible_from_the_seed():
    recipe = load_recipe(TINY, ["data.clients=100", "federation.fraction_train=0.1"])
    count = devices_per_round(recipe.federation, recipe.data.devices)
    assert count == 10
    draws = [sample_devices(100, count, recipe.seed, r) for r in range(1, 6)]
    assert draws == [sample_devices(100, count, recipe.seed, r) for r in range(1, 6)]
    assert len({tuple(d) for d in draws}) == 5, "each round draws anew"
    assert draws != [sample_devices(100, count, recipe.seed + 1, r) for r in range(1, 6)]


def test_the_run_trains_the_seeded_sample_of_devices_each_round(many_clients_run):
    recipe, _, records = many_clients_run
    names = recipe.user_names
    for server_round in (1, 2, 3):
        trained = sorted(r["user"] for r in records if r["kind"] == "train" and r["round"] == server_round)
        assert trained == sorted(names[d] for d in sample_devices(CLIENTS, 3, recipe.seed, server_round))


def test_the_base_model_is_loaded_once_per_worker_process(many_clients_run):
    _, _, records = many_clients_run
    rounds = [r for r in records if r["kind"] == "round"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    handled = sum(r["clients"] for r in rounds)
    assert handled > max(r["workers"] for r in rounds), "workers served several devices and rounds"
    assert all(r["base_loads"] == 1 for r in rounds)


def test_each_round_records_its_wall_time_and_overhead(many_clients_run):
    _, result, records = many_clients_run
    for r in (r for r in records if r["kind"] == "round"):
        assert r["wall_s"] >= r["busiest_worker_s"] >= r["slowest_client_s"] > 0
        assert 0 <= r["overhead"] < 1
        assert r["overhead"] == pytest.approx((r["wall_s"] - r["busiest_worker_s"]) / r["wall_s"])
    assert all(r["handler_s"] > 0 and "worker" not in r for r in records if r["kind"] == "train")
    assert [r["round"] for r in result.summary["round_overhead"]["comigs-1G1S"]] == [1, 2, 3]
    assert "## Round overhead" in (result.run_dir / "report.md").read_text()


def test_device_files_are_removed_once_the_method_ends(many_clients_run):
    recipe, result, _ = many_clients_run
    assert not state_folder(Job(recipe, 0, result.run_dir)).exists()
    assert all((result.run_dir / "checkpoints" / "comigs-1G1S" / f"device_{k}.safetensors").exists()
               for k in range(CLIENTS))


@pytest.mark.parametrize("kind", ["memory", "disk", "auto-small", "auto-large"])
def test_device_state_round_trips_and_costs_nothing_before_the_first_round(kind, tmp_path, monkeypatch):
    if kind == "auto-large":  # a state past the limit, as a method training the whole base keeps
        monkeypatch.setattr("ondevice_moe.federation.device_state.AUTO_DISK_BYTES", 1024)
    job = Job(load_recipe(TINY, [*MANY, f"federation.device_state={kind.split('-')[0]}"]), 0, tmp_path)
    state = RecordDict()
    assert load_device_state(state, with_optimizer=True) == ({}, None) and len(state) == 0
    trainer = dev.restore_trainer(job, 1, None, state)
    dev.run_local_procedure(job, 1, trainer, seed=0)
    dev.save_private_state(job, 1, trainer, state, 1)
    assert list(state) == [STATE_KEY]
    on_disk = kind in ("disk", "auto-large")
    assert (set(state[STATE_KEY]) == {"path"}) == on_disk, "context.state only names the device's file"
    assert (state_folder(job) / "device_1.safetensors").is_file() == on_disk
    private = private_tensors(state)
    assert private and set(private) == {name for name in trainable_state(trainer.model)
                                        if job.method.role_of(name) is Role.PRIVATE}
    again = dev.restore_trainer(job, 1, None, state)
    kept = again.model.state_dict()
    assert all(torch.equal(kept[name], tensor) for name, tensor in private.items())
    saved, restored = trainer.optimizer_state(), again.optimizer_state()
    assert restored["iteration"] == saved["iteration"] > 0
    for key in ("expert", "router"):
        if saved[key] is None:
            continue
        assert restored[key]["param_groups"] == json.loads(json.dumps(saved[key]["param_groups"]))
        for index, moments in saved[key]["state"].items():
            assert all(torch.equal(restored[key]["state"][index][m], t) for m, t in moments.items())
    evaluated = dev.restore_model(job, 1, None, state).state_dict()
    assert all(torch.equal(evaluated[name], tensor) for name, tensor in private.items())
