"""A simulation joins the running Ray cluster ``RAY_ADDRESS`` names, or starts its own without it."""

import json
from pathlib import Path

import pytest

from ondevice_moe import runner
from ondevice_moe.errors import UserError
from ondevice_moe.federation import ray_cluster
from ondevice_moe.federation.localhost import free_port
from ondevice_moe.recipe import load_recipe

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
ONE_STEP = ["methods=[fedavg]", "federation.rounds=1", "federation.local_iterations=1"]


def _results(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.pop("round_overhead")
    return summary


def test_a_run_on_the_joined_cluster_equals_a_run_on_its_own_ray_instance(tmp_path, shared_ray_cluster, monkeypatch):
    import ray

    addresses = []  # the address of every ray.init: ours joining, or Flower's starting an instance
    init = ray.init
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: addresses.append(kwargs.get("address")) or init(
        *args, **kwargs))
    recipe = load_recipe(TINY, ONE_STEP)
    monkeypatch.chdir(tmp_path)  # the actors write the checkpoints into the same relative folder as the run
    joined = runner.run_recipe(recipe, Path("joined")).run_dir
    assert addresses == [shared_ray_cluster]
    monkeypatch.delenv("RAY_ADDRESS")
    own = runner.run_recipe(recipe, Path("own")).run_dir
    assert addresses == [shared_ray_cluster, None]
    assert _results(joined) == _results(own)
    checkpoints = [sorted(p.relative_to(tmp_path / run) for p in (tmp_path / run).rglob("*.safetensors"))
                   for run in (joined, own)]
    assert checkpoints[0] == checkpoints[1] != []
    assert _results(joined)["methods"]["fedavg"]["mean_in"] > 0


def test_a_cluster_address_where_nothing_listens_stops_the_run_before_its_folder_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(UserError, match=r"no Ray cluster answers at RAY_ADDRESS=127\.0\.0\.1:") as raised:
        runner.run_recipe(load_recipe(TINY, ONE_STEP), tmp_path / "run")
    assert "ray start --head" in raised.value.fix and not (tmp_path / "run").exists()


@pytest.mark.parametrize("address", ["127.0.0.1", "host:port", ":6379"])
def test_a_malformed_cluster_address_is_named_with_the_fix(monkeypatch, address):
    monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(UserError, match="is not a host:port address of a running Ray cluster") as raised:
        ray_cluster.check_cluster()
    assert "unset RAY_ADDRESS" in raised.value.fix


def test_without_an_address_nothing_is_checked_and_children_start_their_own_ray(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_cluster.check_cluster()
    assert ray_cluster.cluster_address() is None
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert "RAY_ADDRESS" not in ray_cluster.own_instance_environment()
    assert "RAY_ADDRESS" not in ray_cluster.actor_environment()


def test_the_actors_get_this_processs_environment_import_path_and_working_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("ONDEVICE_MOE_PROBE", "here")
    monkeypatch.setenv("PYTHONPATH", "/extra/path")
    monkeypatch.syspath_prepend("/plugin/path")
    environment = ray_cluster.actor_environment()
    assert environment["ONDEVICE_MOE_PROBE"] == "here"
    assert environment["PYTHONPATH"].split(":")[0] == "/plugin/path"
    assert environment["PYTHONPATH"].split(":")[-1] == "/extra/path"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ray_cluster.DIRECTORY_ENV, ray_cluster.actor_environment()[ray_cluster.DIRECTORY_ENV])
    monkeypatch.chdir("/")  # where `ray start` ran
    ray_cluster.enter_run_directory()
    assert Path.cwd() == tmp_path
