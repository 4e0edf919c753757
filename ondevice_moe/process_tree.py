"""The processes a process started, and theirs: found and stopped by PID.

A run's Flower simulation starts Ray's processes (its GCS server, raylet, agents and workers) below
the process that runs it; a localhost fleet starts a SuperLink and SuperNodes, each with processes of
its own. When such a process must end at once, what it started must end with it, or it lives on as an
orphan that holds memory and ports. Linux only (read from ``/proc``); elsewhere nothing is found.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (its children, theirs, ...), read from ``/proc`` (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


def kill_descendants(pid: int) -> None:
    """SIGKILL every process below ``pid``, the whole tree found first, so that no child of a killed
    parent escapes to ``init`` before it is signalled."""
    for below in descendants(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(below, signal.SIGKILL)
