"""The server's state after each completed round, so a run continues where it stopped.

On real devices a run must outlive its server: after a crash of the SuperLink's machine, or a
stop, the same ``finetune --federation`` command starts a new Flower run that continues from the
last completed round. After every round (training, aggregation, and that round's evaluation and
records all written, or its evaluation riding on the next round's messages:
:mod:`~ondevice_moe.federation.riding`) the ServerApp keeps the server rule's slots and the round's number under
``server_state/<method>/`` in the run folder; each device keeps its own state of every round it
trained (:mod:`ondevice_moe.federation.device_snapshots`). A continued run loads the slots,
drops the records of the round that was cut short, and sends that round again; sampling, data
order and dropout are drawn from (seed, device, round), so the per-user figures are those of an
uninterrupted run.

Each file is written whole or not at all (a temporary file renamed into place); ``round.json``
names the slots file, so a kill between the two writes leaves the previous round in force.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from ondevice_moe.errors import UserError
from ondevice_moe.federation.job import Job
from ondevice_moe.names import folder_name
from ondevice_moe.server_rules.rules import Slots

ROUND_FILE = "round.json"


def state_dir(job: Job) -> Path:
    return job.run_dir / "server_state" / folder_name(job.method.name)


def save_round(job: Job, server_round: int, slots: Slots) -> None:
    """Keep the slots as they stand after ``server_round``; the previous round's file goes once the
    new one is in force."""
    from safetensors.torch import save_file

    folder = state_dir(job)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"slots-{server_round}.safetensors"
    flat = {f"{slot}/{tensor}": value.detach().contiguous().cpu()
            for slot, tensors in slots.items() for tensor, value in tensors.items()}
    partial = folder / (name + ".partial")
    save_file(flat, str(partial), metadata={"slots": json.dumps(sorted(slots))})
    os.replace(partial, folder / name)
    marker = folder / (ROUND_FILE + ".partial")
    marker.write_text(json.dumps({"round": server_round, "slots": name}), encoding="utf-8")
    os.replace(marker, folder / ROUND_FILE)
    for old in folder.glob("slots-*.safetensors"):
        if old.name != name:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()


def load_round(job: Job, empty: Slots) -> tuple[int, Slots]:
    """The last completed round and the slots after it; ``(0, empty)`` for a method not begun."""
    from safetensors import SafetensorError, safe_open

    folder = state_dir(job)
    marker = folder / ROUND_FILE
    if not marker.is_file():
        return 0, empty
    fix = "rerun with --overwrite to start the run afresh"
    try:
        kept = json.loads(marker.read_text(encoding="utf-8"))
        server_round, name = int(kept["round"]), str(kept["slots"])
        if Path(name).name != name:
            raise ValueError(f"slots file {name!r} is not a file name")
        slots: Slots = {slot: {} for slot in empty}
        with safe_open(str(folder / name), framework="pt") as handle:
            slots.update({slot: {} for slot in json.loads(handle.metadata()["slots"])})
            stored = handle.keys()  # a safetensors file is no mapping: it lists its names
            for key in stored:
                slot, tensor = key.split("/", 1)
                slots[slot][tensor] = handle.get_tensor(key)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as error:
        raise UserError(f"the server's state of method '{job.method.name}' in {folder} is damaged "
                        f"({type(error).__name__}: {error})", fix) from None
    return server_round, slots


def forget_rounds(job: Job) -> None:
    """Drop the method's round state: it finished, and its checkpoints hold what it learned."""
    import shutil

    folder = state_dir(job)
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):  # the run's server_state folder, once no method has one
        folder.parent.rmdir()
