"""A fleet of separate hosts that share nothing but a network: a server, three devices, an intruder and
the submitter's laptop, each a Linux network namespace with its own address and its own disk (the
others' folders hidden), as docs/deployment.md's three-machine walk-through sets them up: TLS,
SuperNode keys, ``flower-superlink --host``, ``ondevice-moe device --superlink`` on each device and
``ondevice-moe finetune --federation`` on the laptop.

One run goes through uninterrupted; a second is cut twice (the laptop's command SIGKILLed and run
again, then every process of the server's machine killed and the SuperLink restarted on its
database) and ends with the same per-user figures. A registered node claiming a bound user's slot
is refused and named; a recipe naming a path on a device is refused before anything is sent; no
device's path is anywhere on the server's disk. Every process is started here and stopped by PID,
and every namespace removed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import yaml

from ondevice_moe.federation.netns_fleet import NetnsFleet, available
from ondevice_moe.federation.server_runs import RUNS_ENV

pytestmark = [pytest.mark.slow, pytest.mark.skipif(available() is not None, reason=str(available()))]
BIN = Path(sys.executable).parent
DOC = Path(__file__).resolve().parents[1] / "docs" / "deployment.md"
USERS = ("code", "docs", "tests")
DEVICES = [f"device{device}" for device in range(len(USERS))]
PORT = 9093


def environment(host_folder: Path) -> dict[str, str]:
    return {"HOME": str(host_folder / "home"), "FLWR_HOME": str(host_folder / "home" / ".flwr"),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
            "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "OMP_NUM_THREADS": "1",
            "FLWR_LOG_LEVEL": "INFO", "COLUMNS": "200"}


def doc_block(section: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    return text[text.index(section):].split("```bash\n", 1)[1].split("```", 1)[0]


@pytest.fixture
def fleet(tmp_path):
    hosts = NetnsFleet(tmp_path / "hosts", ["server", *DEVICES, "intruder", "laptop"]).up()
    try:
        yield hosts
    finally:
        hosts.down()
    assert not [line for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
                .splitlines() if line.startswith(hosts.tag + "-")]


def test_a_fleet_survives_its_server_and_its_submitter_and_keeps_slots_paths_and_data_apart(fleet):
    server, laptop = fleet.folder("server"), fleet.folder("laptop")
    # 1. Keys, made on the laptop by the doc's block as written; each machine gets its own files.
    made = fleet.run("laptop", ["bash", "-euo", "pipefail", "-c", doc_block("## 1. Certificates and keys")],
                     env={"SUPERLINK_HOST": "server.fleet", "SUPERLINK_IP": fleet.address("server"), "DEVICES": "5"})
    assert made.returncode == 0, made.stderr
    keys = laptop / "keys"
    (server / "keys").mkdir()
    for name in ("ca.crt", "server.crt", "server.key"):
        shutil.copy(keys / name, server / "keys" / name)
    for index, host in enumerate([*DEVICES, "intruder"]):
        shutil.copy(keys / "ca.crt", fleet.folder(host) / "ca.crt")
        shutil.copy(keys / f"device{index}", fleet.folder(host) / "device.key")
    # 2. The SuperLink, reachable from the other hosts; its runs on its own disk.
    superlink = [str(BIN / "flower-superlink"), "--host", "0.0.0.0", "--port", str(PORT), "--database", "state.db",
                 "--ssl-certfile", "keys/server.crt", "--ssl-keyfile", "keys/server.key", "--ssl-ca-certfile",
                 "keys/ca.crt", "--enable-supernode-auth", "--disable-runtime-dependency-installation"]
    server_env = {**environment(server), RUNS_ENV: str(server / "runs")}
    fleet.start("server", "superlink", superlink, server_env)
    # 3. The laptop names the SuperLink and registers every key.
    flwr_home = laptop / "home" / ".flwr"
    flwr_home.mkdir(parents=True)
    (flwr_home / "config.toml").write_text(f'[superlink.fleet]\naddress = "{fleet.address("server")}:{PORT}"\n'
                                           f'root-certificates = "{keys / "ca.crt"}"\n')
    for index in range(4):
        registered = _until_ok(lambda i=index: fleet.run("laptop", [str(BIN / "flwr"), "supernode", "register",
                                                                    f"keys/device{i}.pub", "fleet"],
                                                         env=environment(laptop)))
        assert registered.returncode == 0, registered.stdout + registered.stderr
    # 4. Each device: its own data, its own state, its SuperNode kept running by `ondevice-moe device`.
    private = _private_folders(fleet)
    for index, host in enumerate([*DEVICES, "intruder"]):
        partition = 1 if host == "intruder" else index  # the intruder claims the docs user's slot
        node_config = (f'partition-id={partition} data-path="{private[host]}" '
                       f'state-dir="{fleet.folder(host) / "state"}"')
        fleet.start(host, "device", [str(BIN / "ondevice-moe"), "device", "--superlink",
                                     f"{fleet.address('server')}:{PORT}", "--superlink-ca", "ca.crt", "--key",
                                     "device.key", "--node-config", node_config], environment(fleet.folder(host)))
    # A stranger on the intruder's machine: Flower's own SuperNode with a key nobody registered.
    shutil.copy(keys / "device4", fleet.folder("intruder") / "stranger.key")
    stranger = fleet.start("intruder", "stranger", [
        str(BIN / "flower-supernode"), "--superlink", f"{fleet.address('server')}:{PORT}", "--root-certificates",
        "ca.crt", "--auth-supernode-private-key", "stranger.key", "--port", "9095", "--node-config",
        f'partition-id=0 state-dir="{fleet.folder("intruder") / "stranger"}"'], environment(fleet.folder("intruder")))
    recipe = laptop / "on-devices.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(rounds=3)))
    bind = [arg for index, user in enumerate(USERS) for arg in ("--bind", f"{user}=keys/device{index}.pub")]

    def finetune(output: str, *extra: str) -> list[str]:
        return [str(BIN / "ondevice-moe"), "finetune", "on-devices.yaml", "--federation", "fleet", "--output",
                f"runs/{output}", *bind, *extra]

    # The uninterrupted run; the intruder, a registered node, is refused and named.
    whole = fleet.run("laptop", finetune("whole"), env=environment(laptop), timeout=600)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "refused" in whole.stdout and "bound to key" in whole.stdout and "insecure" not in whole.stdout
    assert "fedavg 1/3: round 1" in whole.stdout  # progress as lines when the output is no terminal
    assert stranger.popen.wait(60) != 0 and "Failed to activate SuperNode" in stranger.text()  # not registered
    report = (laptop / "runs" / "whole" / "report.md").read_text()
    assert "## Refused nodes" in report and "partition-id 1, which is bound to key" in report
    reference = json.loads((laptop / "runs" / "whole" / "summary.json").read_text())["methods"]
    assert sorted(reference["fedavg"]["per_user"]) == sorted(USERS)

    # The same run, cut: the laptop's command killed after round 1 and run again (it follows the live run) ...
    cut = fleet.start("laptop", "cut", finetune("cut"), environment(laptop))
    _wait_for_round(server / "runs" / "cut", 1)
    fleet.signal(cut)
    again = fleet.start("laptop", "cut-again", finetune("cut"), environment(laptop))
    # ... then every process of the server's machine killed after round 2, and the SuperLink started again.
    _wait_for_round(server / "runs" / "cut", 2)
    fleet.crash("server")
    fleet.start("server", "superlink-again", superlink, server_env)
    assert again.popen.wait(900) == 0, again.text()
    continued = json.loads((laptop / "runs" / "cut" / "summary.json").read_text())["methods"]
    assert {m: v["per_user"] for m, v in continued.items()} == {m: v["per_user"] for m, v in reference.items()}
    assert continued["fedavg"]["continued_after"] == [2]
    assert not (laptop / "runs" / "cut" / "checkpoints").exists()  # models stay on the server and the devices

    # A recipe that names a path on a device is refused on the laptop before anything is sent.
    runs_before = sorted(p.name for p in (server / "runs").iterdir())
    named = _recipe(rounds=1)
    named["data"]["users"][2] = {"name": "tests", "source": "files", "path": "~/notes.txt"}
    (laptop / "named.yaml").write_text(yaml.safe_dump(named))
    refused = fleet.run("laptop", [str(BIN / "ondevice-moe"), "finetune", "named.yaml", "--federation", "fleet",
                                   "--output", "runs/named"], env=environment(laptop))
    assert refused.returncode != 0 and "names places on the devices' disks" in refused.stdout + refused.stderr
    assert "Traceback" not in refused.stdout + refused.stderr
    assert sorted(p.name for p in (server / "runs").iterdir()) == runs_before

    # No device's path anywhere on the server's disk (run folders, the SuperLink's database, logs).
    device_places = [str(fleet.folder(host)) for host in [*DEVICES, "intruder"]]
    for path in server.rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            assert not [place for place in device_places if place.encode() in content], path
    # Each device kept its own checkpoint; nothing of it reached the laptop.
    for index, host in enumerate(DEVICES):
        assert (fleet.folder(host) / "state" / "on-devices" / "checkpoints" / "fedavg" /
                f"device_{index}.safetensors").is_file()


def _recipe(rounds: int) -> dict:
    return {"name": "on-devices", "seed": 0, "model": {"name": "tiny-gpt2"},
            "data": {"context_length": 32, "batch_size": 4, "eval_batch_size": 8, "train_tokens": 3000,
                     "valid_tokens": 800, "test_tokens": 800,
                     "users": [{"name": user, "source": "device"} for user in USERS]},
            "federation": {"rounds": rounds, "local_iterations": 2, "min_clients": 3, "reply_timeout_s": 120,
                           "join_wait_s": 30},
            "methods": ["fedavg"]}


def _private_folders(fleet: NetnsFleet) -> dict[str, Path]:
    """Per device (and the intruder), a folder of text only it has."""
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    folders = {}
    for index, host in enumerate([*DEVICES, "intruder"]):
        folder = fleet.folder(host) / "my-text"
        folder.mkdir()
        for module in stdlib[index * 10:(index + 1) * 10]:
            (folder / f"{module.stem}.txt").write_text(module.read_text(encoding="utf-8", errors="replace"))
        folders[host] = folder
    return folders


def _wait_for_round(server_run: Path, server_round: int, timeout: float = 300) -> None:
    """Wait until the server's run folder logs the end of ``server_round`` (read from outside the hosts)."""
    deadline = time.monotonic() + timeout
    log = server_run / "metrics.jsonl"
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        if any(r.get("kind") == "round" and r.get("round") == server_round
               for r in (json.loads(line) for line in lines if line.endswith("}"))):
            return
        time.sleep(0.3)
    raise AssertionError(f"round {server_round} did not end within {timeout}s")


def _until_ok(attempt, tries: int = 30):
    """``attempt()`` until it exits 0 (the SuperLink is still starting), at most ``tries`` times."""
    for _ in range(tries):
        done = attempt()
        if done.returncode == 0:
            return done
        time.sleep(1)
    return done


def test_the_slow_links_benchmark_runs_a_round_on_rate_limited_hosts(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import slow_links

    figures = slow_links.main(["--recipe", str(Path(__file__).parent / "recipes" / "tiny.yaml"), "--rounds", "1",
                               "--iterations", "1", "--methods", "fedavg", "--transports", "fp32", "int8",
                               "--users", "[{name: code, source: python-code}, {name: news, source: bbc-news}]",
                               "--mbit", "20", "--output", str(tmp_path)])
    fp32, int8 = figures["fp32"]["fedavg"], figures["int8"]["fedavg"]
    assert 3.5 * int8["bytes_up"] < fp32["bytes_up"] and fp32["wire_s"] > 0 and fp32["busiest_s"] > 0
    assert "| fedavg | int8 |" in (tmp_path / "slow_links.md").read_text()
