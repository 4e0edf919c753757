"""Separate hosts on one Linux machine: a fleet of network namespaces that share nothing but a network.

Each host is a network namespace with one veth link into a switch namespace (a bridge), an address
on the fleet's own subnet, and a folder of its own, its disk. Each process of a host runs in that
host's network namespace and in a mount namespace of its own in which every other host's folder is
covered by an empty ``tmpfs``: a device cannot read the server's files, nor the server a device's.
``tc``'s token bucket (:meth:`NetnsFleet.rate_limit`) makes a host's uplink slow. Everything
lives in namespaces this module creates (no address or link is added to the machine's own network)
and goes with them in :meth:`NetnsFleet.down`, which also kills every process still in them.

Needs root and iproute2 (``ip``, ``tc``): the fleet test (tests/test_fleet_hosts.py) and the
slow-link benchmark (benchmarks/slow_links.py) build their hosts with it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ondevice_moe.federation.localhost import Process

SUBNET = "10.77.0"  # the fleet's own addresses, inside its namespaces only


def available() -> str | None:
    """Why a fleet cannot be built here, or ``None`` when it can (root, ``ip``, ``tc``, ``unshare``)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for program in ("ip", "tc"):
        if subprocess.run(["which", program], capture_output=True).returncode != 0:
            return f"`{program}` (iproute2) is not installed"
    return None


@dataclass
class HostProcess(Process):
    """A process of ``host``, started by :meth:`NetnsFleet.start`."""

    host: str = ""


@dataclass
class NetnsFleet:
    """Hosts ``names`` (first one ``.1`` on the subnet, and so on) under ``root``, each with its folder
    ``root/<name>``. ``tag`` keeps this fleet's namespaces apart from another's on the machine."""

    root: Path
    names: list[str]
    tag: str = field(default_factory=lambda: f"f{os.getpid() % 100000}")
    processes: list[HostProcess] = field(default_factory=list)

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.names.index(host) + 1}"

    def folder(self, host: str) -> Path:
        return self.root / host

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    @property
    def switch(self) -> str:
        return f"{self.tag}-switch"

    def up(self) -> NetnsFleet:
        """Create the switch and the hosts, each linked to the switch and given its address."""
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "bridge", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "bridge", "up")
        for index, host in enumerate(self.names):
            namespace, outer = self.namespace(host), f"port{index}"
            self.folder(host).mkdir(parents=True, exist_ok=True)
            _ip("netns", "add", namespace)
            _ip("link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name", outer, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", outer, "master", "bridge")
            _ip("-n", self.switch, "link", "set", outer, "up")
            _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        return self

    def rate_limit(self, host: str, mbit: float) -> None:
        """Limit what ``host`` sends (its uplink) to ``mbit`` Mbit/s with a token bucket."""
        subprocess.run(["tc", "-n", self.namespace(host), "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
                        f"{mbit}mbit", "burst", "32kbit", "latency", "400ms"], check=True, capture_output=True)

    def start(self, host: str, name: str, command: list[str], env: dict[str, str] | None = None) -> HostProcess:
        """Run ``command`` on ``host``, in its folder, the other hosts' folders hidden; output to
        ``<host folder>/<name>.log``."""
        log = self.folder(host) / f"{name}.log"
        with log.open("a", encoding="utf-8") as handle:
            popen = subprocess.Popen(self._on(host, command), env={**os.environ, **(env or {})}, stdout=handle,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        process = HostProcess(name, popen, log, host)
        self.processes.append(process)
        return process

    def run(self, host: str, command: list[str], env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
        """Run ``command`` on ``host`` to its end; its output."""
        return subprocess.run(self._on(host, command), text=True, env={**os.environ, **(env or {})},
                              capture_output=True, timeout=timeout)

    def _on(self, host: str, command: list[str]) -> list[str]:
        """``command`` as ``host`` runs it: in its network namespace and its folder, with a mount namespace
        of its own (``ip netns exec`` makes one) in which the other hosts' folders are empty."""
        hidden = [str(self.folder(other)) for other in self.names if other != host]
        covers = "".join(f"mount -t tmpfs -o size=1m,mode=000 tmpfs {shlex.quote(path)}; " for path in hidden)
        script = f"{covers}cd {shlex.quote(str(self.folder(host)))}; exec {shlex.join(command)}"
        return ["ip", "netns", "exec", self.namespace(host), "bash", "-c", script]

    def signal(self, process: HostProcess, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a process and everything in its session."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.popen.pid, sig)

    def crash(self, host: str) -> None:
        """Every process of ``host`` dies at once, as when the machine loses power."""
        for pid in self.pids(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.pids(host) and time.monotonic() < deadline:
            time.sleep(0.1)
        for process in self.processes:
            if process.host == host:
                process.popen.poll()

    def pids(self, host: str) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", self.namespace(host)], capture_output=True, text=True)
        return [int(pid) for pid in listed.stdout.split()]

    def down(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL) and remove every namespace, with their links."""
        for process in self.processes:
            self.signal(process, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(process.popen.poll() is None for process in self.processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        for host in self.names:
            self.crash(host)
        for namespace in [*(self.namespace(host) for host in self.names), self.switch]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)
