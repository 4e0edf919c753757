"""A real device's state after every round it trained, on its own disk, so it can go back a round.

A run on real devices continues after its server crashed (:mod:`ondevice_moe.federation.round_state`):
the server takes up its last completed round ``r`` and sends round ``r + 1`` again. A device may
already have trained round ``r + 1`` when the server went down, so it must be able to return to
where it stood after round ``r``. After each round it trains, a device writes its Flower context
(its private tensors are a file of that round, :mod:`~ondevice_moe.federation.device_state`) to
``round-<k>.pb`` under ``<state-dir>/<recipe>/device_state/<method>/``. Every message then
restores the state the round asks for: the latest snapshot before the training round, or up to the
evaluated one. It keeps that snapshot and the one before it: the server never goes back further
than the round before the last one it sent.

``run.json`` there names the run the snapshots belong to (its key, from the server, the same in
every Flower run of the run) and the device's own privacy-noise secret; a message of another run
starts the method's state afresh. A device whose SuperNode restarted (its Flower context empty)
reports the round it resumed from (``resumed_round``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from pathlib import Path

from flwr.app import ConfigRecord, Context

from ondevice_moe.errors import UserError
from ondevice_moe.federation.device_state import state_folder
from ondevice_moe.federation.job import Job

RUN_FILE = "run.json"
SNAPSHOT = re.compile(r"round-(\d+)\.pb")
MARK = "device-run"  # in context.state: the run and round the context holds


def enter_run(job: Job, key: str) -> dict[str, object]:
    """The method's folder for run ``key``: kept as it is for the same run; emptied, with a fresh noise
    secret, for another. Returns ``run.json``'s content."""
    folder = state_folder(job)
    path = folder / RUN_FILE
    with contextlib.suppress(OSError, ValueError):
        kept = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(kept, dict) and kept.get("key") == key:
            return kept
    if folder.is_dir():
        for stale in folder.iterdir():
            if stale.is_file() or stale.is_symlink():
                stale.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    fresh = {"key": key, "noise": secrets.randbits(62)}
    _write(path, json.dumps(fresh).encode())
    return fresh


def rounds_kept(job: Job) -> list[int]:
    """The rounds this device kept a snapshot of, in order."""
    folder = state_folder(job)
    if not folder.is_dir():
        return []
    return sorted(int(found.group(1)) for path in folder.iterdir() if (found := SNAPSHOT.fullmatch(path.name)))


def restore(job: Job, context: Context, key: str, upto: int) -> tuple[int, bool]:
    """Make ``context.state`` the state after the latest round ``≤ upto`` this device trained in run
    ``key`` (empty before its first). Returns that round and whether the context had to come back
    from disk (a SuperNode or a Flower run that started since the device last worked)."""
    from flwr.common.serde import context_from_proto
    from flwr.proto.message_pb2 import Context as ProtoContext  # pylint: disable=E0611

    mark = context.state.get(MARK)
    warm = mark is not None and mark.get("key") == key
    for name in list(context.state.keys()):
        del context.state[name]
    kept = [k for k in rounds_kept(job) if k <= upto]
    if not kept:
        context.state[MARK] = ConfigRecord({"key": key, "round": 0})
        return 0, False
    path = state_folder(job) / f"round-{kept[-1]}.pb"
    stored = ProtoContext()
    try:
        stored.ParseFromString(path.read_bytes())
        snapshot = context_from_proto(stored)
    except Exception:  # a damaged file: one clear message (its path stays in the device's own log)
        raise UserError(f"this device's saved state of round {kept[-1]} is damaged",
                        "delete the device's state folder of this run to start it afresh") from None
    for name, record in snapshot.state.items():
        context.state[name] = record
    context.state[MARK] = ConfigRecord({"key": key, "round": kept[-1]})
    return kept[-1], not warm


def keep(job: Job, context: Context, key: str, server_round: int) -> None:
    """Write the context as it stands after training ``server_round``, whole or not at all, and drop
    snapshots older than the one before it (with their tensor files)."""
    from flwr.common.serde import context_to_proto

    context.state[MARK] = ConfigRecord({"key": key, "round": server_round})
    folder = state_folder(job)
    _write(folder / f"round-{server_round}.pb", context_to_proto(context).SerializeToString())
    kept = [k for k in rounds_kept(job) if k < server_round]
    for old in kept[:-1]:
        for name in (f"round-{old}.pb", f"private-{old}.safetensors"):
            with contextlib.suppress(FileNotFoundError):
                (folder / name).unlink()
    for later in [k for k in rounds_kept(job) if k > server_round]:  # an abandoned future of a crashed run
        for name in (f"round-{later}.pb", f"private-{later}.safetensors"):
            with contextlib.suppress(FileNotFoundError):
                (folder / name).unlink()


def noise_secret(job: Job, key: str) -> int:
    """This device's privacy-noise secret for run ``key``: drawn once per run, kept on its disk."""
    return int(enter_run(job, key)["noise"])


def _write(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)
