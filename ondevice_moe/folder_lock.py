"""A folder held by one process at a time, released by the kernel when that process ends.

A run folder is written by one ``finetune`` at a time (``.lock``), and a server's run folder driven by
one ServerApp at a time (``.server.lock``, :mod:`ondevice_moe.federation.server_runs`). The lock is
an advisory ``flock`` on the lock file, not the file's existence: the kernel lets go of it when the
holder ends however it ends (Ctrl-C, SIGKILL, a crash, a power cut), so a lock is never stale, a pid
reused by another process holds nothing, and a killed run's lingering children or zombie do not
hold the folder. The file names its holder (JSON), for the message a second process gets; it is
opened without following a link, so a link planted in its place is refused, not written through.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class FolderBusy(Exception):
    """Another live process holds the folder; ``holder`` is what it wrote of itself."""

    def __init__(self, holder: dict[str, Any]) -> None:
        self.holder = holder
        super().__init__(f"held by {holder}")


@contextlib.contextmanager
def folder_lock(lock: Path, holder: dict[str, Any]) -> Iterator[None]:
    """Hold ``lock`` (a file in the folder it guards) for this process while the block runs, writing
    ``holder`` into it; :class:`FolderBusy` while another process holds it. ``OSError`` where the file
    cannot be opened (a link in its place, a folder without write access)."""
    handle = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderBusy(_holder(handle)) from None
        os.ftruncate(handle, 0)
        os.pwrite(handle, json.dumps(holder).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(handle, 0)  # it holds nothing now; the file stays (removing it would race a newcomer)
    finally:
        os.close(handle)  # releases the lock


@contextlib.contextmanager
def folder_held(folder: Path) -> Iterator[None]:
    """Hold ``folder`` itself (an ``flock`` on the folder, so no lock file lands in it: an export folder
    holds only what it exports) while the block runs; :class:`FolderBusy` while another process holds it."""
    handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderBusy({}) from None
        yield
    finally:
        os.close(handle)


def _holder(handle: int) -> dict[str, Any]:
    with contextlib.suppress(ValueError, TypeError, OSError):
        found = json.loads(os.pread(handle, 4096, 0) or b"{}")
        if isinstance(found, dict):
            return found
    return {}


def live_holder(lock: Path) -> dict[str, Any] | None:
    """What the live process holding ``lock`` wrote of itself (``{}`` if nothing readable), or ``None``
    when no process holds it. Only looks: a shared lock taken and let go at once, never written."""
    try:
        handle = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None  # no lock file (never run) or not one to read: nobody holds it through this file
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(handle)
        fcntl.flock(handle, fcntl.LOCK_UN)
        return None
    finally:
        os.close(handle)

