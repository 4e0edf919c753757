import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_LOG_LEVEL", "ERROR")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI: waiting threads sleep (see cli.py)
# Messages name temporary paths, and rich breaks a word longer than the console: a console wider than
# any such path keeps each one whole, however deep pytest's (or a worker's) tmp folder lies.
os.environ.setdefault("COLUMNS", "200")

import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from ondevice_moe.models.tiny import byte_tokenizer, tiny_gpt2, tiny_llama

VOCAB = 257
RAY = Path(sys.executable).parent / "ray"


def _ray_head_port() -> int:
    """A port the kernel hands out for ``bind(0)``: above Ray's own worker ports (10002-19999 by
    default, which ``ray start`` refuses for its GCS), where ``localhost.free_port`` may draw."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def shared_ray_cluster():
    """One Ray cluster per test worker that every simulation joins through ``RAY_ADDRESS``
    (``ondevice_moe.federation.ray_cluster``) instead of starting and stopping a Ray instance of its
    own; CLI subprocesses inherit the variable. The cluster runs in a session of its
    own and is stopped by its process group at the end. Tests of Ray's own start (``own_ray``) unset
    the variable; a caller who set it keeps their cluster."""
    if os.environ.get("RAY_ADDRESS"):
        yield os.environ["RAY_ADDRESS"]
        return
    port = _ray_head_port()
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # Ray's socket paths must stay short
    log = temp / "start.log"
    with log.open("w") as out:
        head = subprocess.Popen([str(RAY), "start", "--head", "--block", f"--port={port}",
                                 f"--num-cpus={os.cpu_count()}", "--include-dashboard=false", "--disable-usage-stats",
                                 f"--temp-dir={temp}"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
        yield os.environ["RAY_ADDRESS"]
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops the cluster's processes
        try:
            head.wait(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, signal.SIGKILL)  # any process of the cluster still there
            head.wait()
            shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def own_ray(monkeypatch):
    """The simulation starts and stops its own Ray instance, as it does for a user without ``RAY_ADDRESS``."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.fixture(params=["gpt2", "llama"])
def tiny_model(request):
    """A tiny random GPT-2 or LLaMA, frozen, in eval mode."""
    model = (tiny_gpt2 if request.param == "gpt2" else tiny_llama)(VOCAB)
    model.requires_grad_(False)
    return model.eval()


@pytest.fixture
def tokens():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def saved_tiny_models(tmp_path_factory):
    """Tiny random models saved as local folders (``name -> folder``), so that they load through the
    real ``from_pretrained`` path, bitsandbytes quantization included: ``tiny-llama`` a causal LM,
    ``tiny-bert`` an encoder without a head (a classifier gets a fresh head with any number of labels)."""
    from ondevice_moe.models.tiny import tiny_model as build_tiny

    folders = {}
    for name, num_labels in (("tiny-llama", None), ("tiny-bert", 2)):
        folder = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        model = build_tiny(name, VOCAB, num_labels)
        (model.bert if num_labels else model).save_pretrained(folder)
        byte_tokenizer().save_pretrained(folder)
        folders[name] = folder
    return folders


@pytest.fixture(scope="session")
def runs_on_each_split(tmp_path_factory):
    """``run(recipe_path, split_key, overrides)``: the recipe run twice, once scored on each split
    (``split_key=test`` and ``split_key=valid``, the same training otherwise); ``split -> RunResult``."""
    from ondevice_moe import runner
    from ondevice_moe.recipe import load_recipe

    def run(recipe_path: Path, split_key: str, overrides: list[str]) -> dict:
        runs = {}
        for split in ("test", "valid"):
            recipe = load_recipe(recipe_path, [f"{split_key}={split}", *overrides])
            runs[split] = runner.run_recipe(recipe, tmp_path_factory.mktemp(split) / "run")
        return runs

    return run


@pytest.fixture(scope="session")
def tiny_llama_run(tmp_path_factory, saved_tiny_models) -> Path:
    """One finished run the tests that only read a run share (export, opening a user's model, the generate
    benchmark): the tiny recipe on a saved tiny LLaMA (it loads through ``from_pretrained``, as PEFT's
    loaders need), FedAvg, CoMiGS-1G1S and the two-module FedAvg, one round of one step. Tests write beside it,
    never into it."""
    from ondevice_moe.recipe import load_recipe
    from ondevice_moe.runner import run_recipe

    recipe = load_recipe(Path(__file__).parent / "recipes" / "tiny.yaml", [
        f"model.name={saved_tiny_models['tiny-llama']}", "federation.rounds=1", "federation.local_iterations=1",
        "methods=[fedavg, {name: comigs, variant: 1G1S}, fedavg-two-lora]"])
    return run_recipe(recipe, tmp_path_factory.mktemp("tiny-llama-run") / "tiny").run_dir


@pytest.fixture(scope="session")
def ifca_run(tmp_path_factory) -> Path:
    """A finished IFCA run of the tiny FedSoft recipe, shared by the tests that score its saved centres."""
    from ondevice_moe import runner
    from ondevice_moe.recipe import load_recipe

    run = tmp_path_factory.mktemp("ifca") / "run"
    recipe = load_recipe(Path(__file__).parent / "recipes" / "tiny-fedsoft-lm.yaml", ["methods=[ifca]"])
    runner.run_recipe(recipe, run)
    return run


# The files that take minutes on 2 cores (`make test`, durations of a full run), longest first. `make test`
# hands whole files to two workers in collection order (`--dist loadfile --no-loadscope-reorder`): these go
# first so that the short files fill the other worker meanwhile and both end together (xdist's own order,
# by number of tests, left a one-test file of two minutes for the end).
LONGEST_FILES = ("test_benchmarks.py", "test_install.py", "test_fleet_hosts.py", "test_deployment.py",
                 "test_fair_baselines.py", "test_resume.py", "test_quickstart_slow.py", "test_task_validation.py",
                 "test_examples.py", "test_federation.py")


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: position for position, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
