"""Where a run on real devices lives on the server, and who may drive it.

A run submitted with ``ondevice-moe finetune --federation`` is written where its ServerApp runs (the
SuperLink's machine), never where it was submitted from: the run config names the run by a plain
name, and the ServerApp keeps its folder under :func:`server_runs_root` (``$ONDEVICE_MOE_RUNS``,
default ``~/.ondevice-moe/runs``). The submitting machine gets the folder's files through Flower
(:mod:`ondevice_moe.federation.log_channel`).

One run folder has at most one live ServerApp: :func:`server_lock` holds ``.server.lock``
(:mod:`ondevice_moe.folder_lock`) for as long as the ServerApp lives; the kernel releases it when that
process ends however it ends (a crash, SIGKILL, the machine going down), so it is never stale. A
second Flower run for the same folder is told which run holds it (:class:`RunBusy`), and the
submitter follows that one instead.

:class:`RunIdentity` (``federation.json``) is what a run keeps across its Flower runs: its key
(sent to every device, so a device tells a continued run from a new one) and which SuperNode key
holds each user slot (:mod:`ondevice_moe.federation.slots`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ondevice_moe.errors import UserError
from ondevice_moe.folder_lock import FolderBusy, folder_lock
from ondevice_moe.names import name_problem

RUNS_ENV = "ONDEVICE_MOE_RUNS"
LOCK_FILE = ".server.lock"
IDENTITY_FILE = "federation.json"


def server_runs_root() -> Path:
    """The folder the ServerApp keeps run folders in: ``$ONDEVICE_MOE_RUNS`` in the SuperLink's
    environment, by default ``~/.ondevice-moe/runs`` of the user the SuperLink runs as."""
    configured = os.environ.get(RUNS_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".ondevice-moe" / "runs"


def server_run_dir(name: str) -> Path:
    """The server's folder of the run named ``name`` (a plain name, never a path)."""
    problem = name_problem("run name", name)
    if problem:
        raise UserError(problem, "name the run with --output (its last part names the run on the server)")
    return server_runs_root() / name


class RunBusy(Exception):
    """Another ServerApp (Flower run ``flower_run``) is driving this run folder now."""

    def __init__(self, flower_run: int) -> None:
        self.flower_run = flower_run
        super().__init__(f"Flower run {flower_run} is driving this run now")


@contextlib.contextmanager
def server_lock(run_dir: Path, flower_run: int) -> Iterator[None]:
    """Hold ``run_dir`` for this ServerApp (Flower run ``flower_run``) while the block runs
    (:func:`~ondevice_moe.folder_lock.folder_lock`); a folder another live ServerApp holds is :class:`RunBusy`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        with folder_lock(run_dir / LOCK_FILE, {"flower_run": flower_run, "pid": os.getpid()}):
            yield
    except FolderBusy as busy:
        raise RunBusy(int(busy.holder.get("flower_run", 0))) from None
    except OSError as error:
        raise UserError(f"cannot lock the run folder {run_dir} ({error.strerror})",
                        f"remove {run_dir / LOCK_FILE} if it is not a plain file, and run again") from None


@dataclass
class RunIdentity:
    """What a run keeps across its Flower runs (``federation.json`` in its folder): ``key``, which
    devices are told so that they tell this run from another; ``claims``: user slot → the SuperNode
    public key (its fingerprint) that holds it; ``bound``: slots the submitter bound to a key up
    front (``--bind``)."""

    path: Path
    key: str
    claims: dict[int, str] = field(default_factory=dict)
    bound: dict[int, str] = field(default_factory=dict)

    @classmethod
    def open(cls, run_dir: Path, bound: dict[int, str]) -> RunIdentity:
        """The run's identity, created on its first Flower run. Bindings are fixed then: a later
        Flower run of the same run keeps the first ones (a slot's key cannot change mid-run)."""
        path = run_dir / IDENTITY_FILE
        if not path.is_file():
            identity = cls(path, secrets.token_hex(16), {}, dict(bound))
            identity.save()
            return identity
        try:
            raw: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
            return cls(path, str(raw["key"]), {int(k): str(v) for k, v in raw.get("claims", {}).items()},
                       {int(k): str(v) for k, v in raw.get("bound", {}).items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise UserError(f"the run's {path} is damaged ({type(error).__name__})",
                            "rerun with --overwrite to start the run afresh") from None

    def claim(self, device: int, fingerprint: str) -> None:
        """Record that the key ``fingerprint`` holds slot ``device`` from now on, for the whole run."""
        self.claims[device] = fingerprint
        self.save()

    def save(self) -> None:
        payload = {"key": self.key, "claims": self.claims, "bound": self.bound}
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(payload, sort_keys=True), encoding="utf-8")
        os.replace(partial, self.path)


def forget_identity(run_dir: Path) -> None:
    """Drop the run's identity (``--overwrite`` starts a new run in the folder)."""
    with contextlib.suppress(FileNotFoundError):
        (run_dir / IDENTITY_FILE).unlink()
