"""Every part of a real deployment on localhost: a ``flower-superlink`` and ``flower-supernode``
processes (``ondevice_moe.federation.localhost``), ``ondevice-moe finetune --federation`` submitting to
it, each device with a ``data-path`` folder only it has and a ``state-dir`` of its own."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import yaml

from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.federation.localhost import LocalFederation, environment
from ondevice_moe.recipe import validate_recipe
from ondevice_moe.training import trainable_state

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
USERS = ("code", "docs", "tests")


DEPLOYMENT_DOC = Path(__file__).resolve().parents[1] / "docs" / "deployment.md"


def device_folders(root: Path) -> list[Path]:
    """Per device, a folder of text only it has: different standard-library modules for each."""
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    folders = []
    for device in range(len(USERS)):
        folder = root / f"private-{USERS[device]}"
        folder.mkdir(parents=True)
        for module in stdlib[device * 12:(device + 1) * 12]:
            (folder / f"{module.stem}.txt").write_text(module.read_text(encoding="utf-8", errors="replace"),
                                                       encoding="utf-8")
        folders.append(folder)
    return folders


def device_recipe(path: Path, method: object, rounds: int, timeout: float) -> dict:
    raw = {"name": "on-devices", "seed": 0, "model": {"name": "tiny-gpt2"},
           "data": {"context_length": 32, "batch_size": 4, "eval_batch_size": 8, "train_tokens": 3000,
                    "valid_tokens": 800, "test_tokens": 800,
                    "users": [{"name": user, "source": "device"} for user in USERS]},
           "federation": {"rounds": rounds, "local_iterations": 2, "min_clients": 2, "reply_timeout_s": timeout,
                          "eval_every": rounds},
           "training": {"router_period": 2, "router_steps": 1},
           "methods": [method]}
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return raw


def finetune_command(recipe: Path, output: Path) -> list[str]:
    return [str(BIN / "ondevice-moe"), "finetune", str(recipe), "--federation", "local-test", "--output", str(output)]


def finetune(recipe: Path, output: Path, cli_home: Path) -> subprocess.Popen:
    return subprocess.Popen(finetune_command(recipe, output), env=environment(cli_home), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def records(output: Path) -> list[dict]:
    path = output / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for(server_run: Path, kind: str, server_round: int | None, process: subprocess.Popen,
             timeout: float = 300) -> None:
    """Wait until the server's run folder logs a ``kind`` record of ``server_round`` (any round: ``None``)."""
    deadline = time.monotonic() + timeout
    while not any(r["kind"] == kind and server_round in (None, r.get("round")) for r in records(server_run)):
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, f"no {kind} record of round {server_round} within {timeout}s"
        time.sleep(0.5)


def test_devices_keep_their_data_and_private_state_and_a_killed_device_resumes(tmp_path):
    """Insecure link, one ``ondevice-moe device`` process per device; the run is stopped with
    ``finetune --stop`` after round 2 and continued by the same command."""
    data = device_folders(tmp_path / "data")
    recipe_file = tmp_path / "recipe.yaml"
    raw = device_recipe(recipe_file, {"name": "comigs", "variant": "1G1S"}, rounds=4, timeout=40)
    federation = LocalFederation(tmp_path / "federation")
    try:
        federation.start_superlink()
        nodes = [federation.start_supernode(device, data[device], warm=True) for device in range(len(USERS))]
        impostor = federation.start_supernode(1, data[1], name="impostor", warm=True)  # a second claim to device 1
        federation.connection_config(tmp_path / "cli")
        output = tmp_path / "server-run"
        run = finetune(recipe_file, output, tmp_path / "cli")
        wait_for(federation.server_runs() / output.name, "comm", 1, run)
        federation.kill(nodes[2])  # SIGKILL mid-run, then the device comes back with the same state-dir
        time.sleep(2)
        federation.start_supernode(2, data[2], warm=True)
        wait_for(federation.server_runs() / output.name, "rejoin", None, run)  # however slow the machine
        wait_for(federation.server_runs() / output.name, "round", 2, run)
        stop = subprocess.run([*finetune_command(recipe_file, output), "--stop"], env=environment(tmp_path / "cli"),
                              capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0 and "stopped Flower run" in stop.stdout, stop.stdout + stop.stderr
        out, _ = run.communicate(timeout=300)
        assert run.returncode == 2 and "was stopped" in out and "run the same command again" in out, out
        assert (federation.server_runs() / output.name / "report.md").is_file()  # the stop wrote it, on the server
        run = finetune(recipe_file, output, tmp_path / "cli")  # the same command continues it
        out, _ = run.communicate(timeout=600)
        assert run.returncode == 0, out
    finally:
        federation.stop()
    log = records(output)
    summary = json.loads((output / "summary.json").read_text())
    method = summary["methods"]["comigs-1G1S"]
    assert sorted(method["per_user"]) == sorted(USERS)  # the restarted device answered the final evaluation
    assert "mean_out" not in method  # no device read another's data
    assert "not measured" in (output / "report.md").read_text()
    # The device that was killed rejoined under a new node id and resumed its private state from disk.
    assert [r["device"] for r in log if r["kind"] == "rejoin"] == [2]
    trained = sorted((r["round"], r) for r in log if r["kind"] == "train" and r["user"] == "tests" and r["round"] > 1)
    assert trained and trained[0][1]["resumed_round"] == 1
    # The stopped run continued from the round it had completed, every device from its own disk.
    continued = method["continued_after"]
    assert len(continued) == 1 and continued[0] >= 2
    after = [r for r in log if r["kind"] == "train" and r["round"] == continued[0] + 1]
    assert len(after) == len(USERS) and all(r["resumed_round"] >= 1 for r in after)
    # The impostor (or the device it raced) was refused, with the reason in the log and on the node.
    refused = [r for r in log if r["kind"] == "refused"]
    assert refused and "claims partition-id 1" in refused[0]["reason"]
    assert "the server refused this device" in (impostor.text() + nodes[1].text())
    # Private tensors never travelled: each upload was exactly the shared experts' bytes.
    job = Job(validate_recipe(raw), 0, tmp_path)
    reference = dev.upload_reference(job, 0)
    kept = [name for name in trainable_state(dev.build_model(job, 0)) if name not in reference]
    assert kept and all(".private_" in name or "router" in name for name in kept)
    assert reference and not any(".private_" in name or "router" in name for name in reference)
    shared_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    assert {r["bytes_up"] for r in log if r["kind"] == "train"} == {shared_bytes}
    # The server's folder holds no device's checkpoint; each device's state-dir holds its own.
    server_run = federation.server_runs() / output.name
    assert not list((server_run / "checkpoints").rglob("device_*"))  # only the server's shared experts
    assert (server_run / "checkpoints" / "comigs-1G1S" / "server.safetensors").is_file()
    assert not (output / "checkpoints").exists()  # the submitter got the report and records, not the models
    # One process per device: every round's handlers ran in at most one process per device, each loading
    # the base once; the TLS test below runs Flower's default, a process per message.
    rounds = [r for r in log if r["kind"] == "round"]
    assert rounds and all(r["workers"] <= len(USERS) and r["base_loads"] == 1 for r in rounds)
    for device in range(len(USERS)):  # device 1: on whichever of it and the impostor the server kept
        homes = ["device1", "impostor"] if device == 1 else [f"device{device}"]
        states = [tmp_path / "federation" / home / "state" / "on-devices" for home in homes]
        kept_state = [state for state in states
                      if (state / "checkpoints" / "comigs-1G1S" / f"device_{device}.safetensors").is_file()]
        assert len(kept_state) == 1 and (kept_state[0] / "device_state" / "comigs-1G1S" / "round-3.pb").is_file()


def test_the_deployment_benchmark_runs_on_devices_with_flowers_process_per_message(tmp_path, monkeypatch):
    """Flower's default isolation, a fresh ``flwr-clientapp`` process per message (the other tests run
    ``ondevice-moe device``, one process per device)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import deployment_rounds

    figures = deployment_rounds.main(["--recipe", str(Path(__file__).parent / "recipes" / "tiny.yaml"),
                                      "--rounds", "1", "--iterations", "1", "--modes", "deployment",
                                      "--output", str(tmp_path)])
    measured = figures["deployment"]
    assert measured["workers_per_round"] == 2 * 3  # a process for each device's train and evaluate message
    assert 0 < measured["busiest_worker_s"] < measured["round_wall_s"] and measured["mean_in"]["fedavg"] > 1
    assert measured["wire_s"] > 0 and measured["over_busiest"] > 0
    assert "| deployment |" in (tmp_path / "deployment_rounds.md").read_text()


def test_the_localhost_federation_starts_every_process_with_the_flags_the_deployment_doc_gives(tmp_path):
    """docs/deployment.md's SuperLink, device and SuperNode commands and the processes these tests start
    take the same flags, so following the doc is what the tests above do."""
    doc = DEPLOYMENT_DOC.read_text(encoding="utf-8")

    def flags(section: str, program: str) -> set[str]:
        text = doc[doc.index(section):]
        blocks = [block.split("```", 1)[0] for block in text.split("```bash\n")[1:]]
        block = next(block for block in blocks if program in block)
        command = block[block.index(program):].replace("\\\n", " ").split("\n", 1)[0]
        return {word for word in command.split() if word.startswith("--")}

    keys = {"ca_cert": tmp_path / "ca.crt", "server_cert": tmp_path / "s.crt", "server_key": tmp_path / "s.key"}
    federation = LocalFederation(tmp_path, keys)
    superlink = set(federation.superlink_command(tmp_path))
    supernode = set(federation.supernode_command("partition-id=0", 9094, tmp_path / "device0"))
    device = set(federation.device_command("partition-id=0", 9094, tmp_path / "device0"))
    assert flags("## 2. The SuperLink", "flower-superlink") <= superlink
    assert flags("## 4. Each device", "ondevice-moe device") <= device
    assert flags("## 4. Each device", "flower-supernode") <= supernode
    assert flags("## One process per device", "flower-supernode") - {"--isolation"} <= supernode
