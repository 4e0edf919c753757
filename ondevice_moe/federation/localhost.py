"""A real Flower deployment on one machine: one ``flower-superlink`` and one ``flower-supernode`` per
device, each process in its own working folder with its own home, on free loopback ports below the
ephemeral range (:func:`free_port`), every process stopped by its PID (its whole session) at the
end. For trying the deployment path on a laptop, and for the deployment tests and benchmarks
(tests/test_deployment.py, benchmarks/deployment_rounds.py); the commands are those of
docs/deployment.md.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ondevice_moe.federation.server_runs import RUNS_ENV
from ondevice_moe.process_tree import descendants, kill_descendants

BIN = Path(sys.executable).parent


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000  # below it lie well-known services' ports
PORT_TRIES = 64


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range where that range is known.

    A port the kernel hands out for ``bind(0)`` lies in the ephemeral range, from which it also
    picks the source port of every outgoing connection: in the seconds between this probe and the
    server binding the port, one of the processes' own HTTP requests could take it (a restarted
    SuperNode then died with "address already in use"). Ports below the range are only ever taken
    by an explicit bind; they are drawn at random so that parallel test workers do not race for
    the same one.
    """
    first_ephemeral = _first_ephemeral_port()
    if first_ephemeral > LOWEST_PORT:
        for port in random.SystemRandom().sample(range(LOWEST_PORT, first_ephemeral),
                                                 min(PORT_TRIES, first_ephemeral - LOWEST_PORT)):
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _first_ephemeral_port() -> int:
    """The first port of the kernel's ephemeral range, or 0 where it is not known (not Linux)."""
    try:
        return int(EPHEMERAL_PORTS.read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def environment(home: Path) -> dict[str, str]:
    """A process's environment: its own HOME and FLWR_HOME, the test's venv first on PATH, offline; the
    model cache of the user running it (each process converting SmolLM2's GGUF again would cost 15 s
    and 1.2 GB)."""
    home.mkdir(parents=True, exist_ok=True)
    cache = os.environ.get("ONDEVICE_MOE_CACHE") or str(Path.home() / ".cache" / "ondevice-moe")
    return {**os.environ, "HOME": str(home), "FLWR_HOME": str(home / ".flwr"), "ONDEVICE_MOE_CACHE": cache,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
            "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "OMP_NUM_THREADS": "1",
            "FLWR_LOG_LEVEL": "INFO"}  # each process's log says what it sent and received


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


@dataclass
class LocalFederation:
    """``root``: the test's folder; ``secure``: a dict of TLS and authentication files, or ``None``."""

    root: Path
    secure: dict[str, Path] | None = None
    port: int = field(default_factory=free_port)
    processes: list[Process] = field(default_factory=list)

    def start_superlink(self) -> Process:
        """The SuperLink; the ServerApps it starts keep their run folders under :meth:`server_runs`."""
        folder = self.root / "superlink"
        folder.mkdir(parents=True, exist_ok=True)
        process = self._start("superlink", self.superlink_command(folder), folder,
                              {RUNS_ENV: str(self.server_runs())})
        self._wait_for_port()
        return process

    def server_runs(self) -> Path:
        """Where the server keeps its run folders (``$ONDEVICE_MOE_RUNS`` of the SuperLink)."""
        return self.root / "superlink" / "runs"

    def superlink_command(self, folder: Path) -> list[str]:
        """``flower-superlink`` as docs/deployment.md starts it (insecure where no certificates were given)."""
        command = [str(BIN / "flower-superlink"), "--host", "127.0.0.1", "--port", str(self.port), "--database",
                   str(folder / "state.db"), "--disable-runtime-dependency-installation"]
        if self.secure is None:
            return [*command, "--insecure"]
        return [*command, "--ssl-certfile", str(self.secure["server_cert"]), "--ssl-keyfile",
                str(self.secure["server_key"]), "--ssl-ca-certfile", str(self.secure["ca_cert"]),
                "--enable-supernode-auth"]

    def supernode_command(self, node_config: str, runtime_port: int, private_key: Path | None) -> list[str]:
        """``flower-supernode`` as docs/deployment.md starts it on a device."""
        command = [str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{self.port}", "--port",
                   str(runtime_port), "--node-config", node_config]
        if self.secure is None:
            return [*command, "--insecure"]
        command += ["--root-certificates", str(self.secure["ca_cert"])]
        return command + (["--auth-supernode-private-key", str(private_key)] if private_key is not None else [])

    def start_supernode(self, partition: int, data_path: Path | None, name: str | None = None,
                        private_key: Path | None = None, warm: bool = False) -> Process:
        """A SuperNode for ``partition``; ``warm``: one ``ondevice-moe device --superlink`` process instead,
        which starts the SuperNode with ``--isolation process``, keeps it running, and runs every message
        itself (one process per device, docs/deployment.md)."""
        name = name or f"device{partition}"
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        node_config = f'partition-id={partition} state-dir="{folder / "state"}"'
        if data_path is not None:
            node_config += f' data-path="{data_path}"'
        runtime_port = free_port()
        if warm:
            return self._start(name, self.device_command(node_config, runtime_port, private_key), folder)
        return self._start(name, self.supernode_command(node_config, runtime_port, private_key), folder)

    def device_command(self, node_config: str, runtime_port: int, private_key: Path | None) -> list[str]:
        """``ondevice-moe device --superlink`` as docs/deployment.md starts it on a device."""
        command = [str(BIN / "ondevice-moe"), "device", "--superlink", f"127.0.0.1:{self.port}", "--node-config",
                   node_config, "--runtime-api", f"127.0.0.1:{runtime_port}"]
        if self.secure is None:
            return [*command, "--insecure"]
        command += ["--superlink-ca", str(self.secure["ca_cert"])]
        return command + (["--key", str(private_key)] if private_key is not None else [])

    def connection_config(self, home: Path, name: str = "local-test") -> Path:
        """Flower's CLI connection config naming this SuperLink ``name``, in ``home``'s ``.flwr``."""
        flwr_home = home / ".flwr"
        flwr_home.mkdir(parents=True, exist_ok=True)
        security = ('root-certificates = "' + str(self.secure["ca_cert"]) + '"' if self.secure
                    else "insecure = true")
        path = flwr_home / "config.toml"
        path.write_text(f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\n'
                        f'address = "127.0.0.1:{self.port}"\n{security}\n', encoding="utf-8")
        return path

    def kill(self, process: Process) -> None:
        """SIGKILL a process and every process it started (the SuperLink's SuperExec and ServerApps run in
        sessions of their own): as when its machine goes down."""
        kill_descendants(process.popen.pid)
        _kill_group(process.popen, signal.SIGKILL)
        process.popen.wait(10)

    def stop(self) -> None:
        started = {pid for process in self.processes for pid in descendants(process.popen.pid)}
        for process in reversed(self.processes):
            _kill_group(process.popen, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes:
            try:
                process.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(process.popen, signal.SIGKILL)
                process.popen.wait(5)
        for pid in started:  # what they started in sessions of its own, and left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _start(self, name: str, command: list[str], folder: Path, extra: dict[str, str] | None = None) -> Process:
        log = folder / f"{name}.log"
        handle = log.open("a", encoding="utf-8")
        popen = subprocess.Popen(command, cwd=folder, env={**environment(folder / "home"), **(extra or {})},
                                 stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def _wait_for_port(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the SuperLink did not open port {self.port} within {timeout:g}s")


def _kill_group(popen: subprocess.Popen, sig: int) -> None:
    """Signal the process's whole session (it and what it started), by its PID."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, sig)  # also after the leader exited: what it started may live on
