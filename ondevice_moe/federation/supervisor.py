"""A device's SuperNode, kept running: restarted with growing pauses whenever it exits.

``flower-supernode`` exits when the SuperLink will not activate it (exit code 305): after a crash,
the SuperLink counts the device's last session live until its heartbeats are missed (about a
minute), and a SuperNode restarted within that minute, as a service manager restarts it, is
refused and never tries again. ``ondevice-moe device --superlink ...`` starts the SuperNode as its
child and starts it again after each exit, waiting :data:`FIRST_PAUSE_S` seconds, then twice as
long each time up to :data:`LONGEST_PAUSE_S`, and from the first pause again once a SuperNode
stayed up :data:`SETTLED_S` seconds. A stop (SIGTERM, Ctrl-C) stops the SuperNode gracefully:
Flower then marks the device offline at once, so the device's next start is let in at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from logging import INFO, WARNING
from pathlib import Path

from ondevice_moe.federation.supernode_pace import POLL_S

FIRST_PAUSE_S = 2.0
LONGEST_PAUSE_S = 60.0
SETTLED_S = 60.0
REFUSED_ACTIVATION = 305  # Flower's exit code: the SuperLink did not activate the SuperNode
EXIT_CODE = re.compile(r"Exit Code: (\d+)")  # how Flower names why it exits (the process itself exits with 1)


def supernode_command(superlink: str, node_config: str, runtime_port: int, certificates: Path | None,
                      private_key: Path | None, poll_s: float = POLL_S) -> list[str]:
    """``flower-supernode`` handing its tasks to an executor on ``runtime_port`` (``--isolation process``),
    asking for work every ``poll_s`` seconds (:mod:`~ondevice_moe.federation.supernode_pace`); insecure
    where no CA certificate is given."""
    command = [sys.executable, "-m", "ondevice_moe.federation.supernode_pace", f"{poll_s:g}", "--superlink",
               superlink, "--node-config", node_config, "--isolation", "process", "--port", str(runtime_port)]
    command += ["--root-certificates", str(certificates)] if certificates is not None else ["--insecure"]
    return command + (["--auth-supernode-private-key", str(private_key)] if private_key is not None else [])


def pause_after(failures: int) -> float:
    """The pause before the next start, after ``failures`` exits in a row."""
    return min(FIRST_PAUSE_S * 2 ** max(failures - 1, 0), LONGEST_PAUSE_S)


def why_it_exited(code: int) -> str:
    """In words, why a SuperNode exited with Flower's exit code ``code`` (what it printed)."""
    if code == REFUSED_ACTIVATION:
        return ("the SuperLink did not activate it (exit code 305: it still counts this device's last session live "
                "until that session's heartbeats are missed, or the device's key is not registered)")
    return f"it exited (Flower's exit code {code})"


class Supervisor:
    """Keeps ``command`` (a SuperNode) running in a process group of its own until :meth:`stop`."""

    def __init__(self, command: list[str], log: Callable[..., None]) -> None:
        self.command = command
        self.log = log
        self.starts = 0
        self._process: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._keep_running, name="supernode-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, grace: float = 20.0) -> None:
        """Stop the SuperNode gracefully (SIGTERM), SIGKILL after ``grace`` seconds."""
        self._stopping.set()
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
        self._thread.join(5)

    def _keep_running(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            started = time.monotonic()
            self._process = subprocess.Popen(self.command, start_new_session=True, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True, errors="replace")
            self.starts += 1
            code = self._relay(self._process)
            if self._stopping.is_set():
                return
            failures = 1 if time.monotonic() - started > SETTLED_S else failures + 1
            pause = pause_after(failures)
            self.log(WARNING, "the SuperNode stopped: %s; starting it again in %.0f s", why_it_exited(code), pause)
            self._stopping.wait(pause)
        self.log(INFO, "the SuperNode supervisor stopped")

    @staticmethod
    def _relay(process: subprocess.Popen) -> int:
        """Pass the SuperNode's output on to this process's, until it exits; Flower's exit code (what it
        printed as ``Exit Code: N``, else the process's own)."""
        code = None
        for line in process.stdout:
            sys.stdout.write(line)
            found = EXIT_CODE.search(line)
            if found:
                code = int(found.group(1))
        sys.stdout.flush()
        status = process.wait()
        return code if code is not None else status
