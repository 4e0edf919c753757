"""A real Flower deployment on this machine, for tests: one ``flower-superlink`` and one
``flower-supernode`` per device, each process with its own working folder and home, on
loopback ports chosen free by the test, every process stopped by PID at the end."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def environment(home: Path) -> dict[str, str]:
    """A process's environment: its own HOME and FLWR_HOME, the test's venv first on PATH, offline."""
    home.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "HOME": str(home), "FLWR_HOME": str(home / ".flwr"),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
            "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "OMP_NUM_THREADS": "1"}


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
        folder = self.root / "superlink"
        folder.mkdir(parents=True, exist_ok=True)
        command = [str(BIN / "flower-superlink"), "--port", str(self.port), "--database", str(folder / "state.db"),
                   "--disable-runtime-dependency-installation"]
        if self.secure is None:
            command.append("--insecure")
        else:
            command += ["--ssl-certfile", str(self.secure["server_cert"]), "--ssl-keyfile",
                        str(self.secure["server_key"]), "--ssl-ca-certfile", str(self.secure["ca_cert"]),
                        "--enable-supernode-auth"]
        process = self._start("superlink", command, folder)
        self._wait_for_port()
        return process

    def start_supernode(self, partition: int, data_path: Path | None, name: str | None = None,
                        private_key: Path | None = None) -> Process:
        name = name or f"device{partition}"
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        node_config = f'partition-id={partition} state-dir="{folder / "state"}"'
        if data_path is not None:
            node_config += f' data-path="{data_path}"'
        command = [str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{self.port}", "--port",
                   str(free_port()), "--node-config", node_config]
        if self.secure is None:
            command.append("--insecure")
        else:
            command += ["--root-certificates", str(self.secure["ca_cert"])]
            if private_key is not None:
                command += ["--auth-supernode-private-key", str(private_key)]
        return self._start(name, command, folder)

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
        """SIGKILL a process and the ClientApp / SuperExec processes it started."""
        _kill_group(process.popen, signal.SIGKILL)

    def stop(self) -> None:
        for process in reversed(self.processes):
            _kill_group(process.popen, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes:
            try:
                process.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(process.popen, signal.SIGKILL)
                process.popen.wait(5)

    def _start(self, name: str, command: list[str], folder: Path) -> Process:
        log = folder / f"{name}.log"
        handle = log.open("a", encoding="utf-8")
        popen = subprocess.Popen(command, cwd=folder, env=environment(folder / "home"), stdout=handle,
                                 stderr=subprocess.STDOUT, start_new_session=True)
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


def make_security(folder: Path, devices: int) -> dict[str, Path]:
    """A CA, a SuperLink certificate for 127.0.0.1 and localhost signed by it, and an ECDSA key pair
    per device for SuperNode authentication (openssl and ssh-keygen, as docs/deployment.md does)."""
    folder.mkdir(parents=True, exist_ok=True)
    run = lambda *command: subprocess.run(command, cwd=folder, check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", "ca.key",
        "-out", "ca.crt", "-subj", "/CN=ondevice-moe test CA")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=localhost")
    (folder / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n", encoding="utf-8")
    run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "san.ext")
    files = {"ca_cert": folder / "ca.crt", "server_cert": folder / "server.crt", "server_key": folder / "server.key"}
    for device in range(devices):
        run("ssh-keygen", "-t", "ecdsa", "-b", "384", "-N", "", "-q", "-f", f"node{device}")
        files[f"node{device}"] = folder / f"node{device}"
    return files
