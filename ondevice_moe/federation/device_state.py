"""What a device keeps between rounds: its private tensors and its optimisers' state.

Flower keeps each device's ``context.state``; in the simulation every device's lives in the
driver process and travels to the worker that serves the device's next message, and back.
A device that was never sampled keeps nothing. A device that trained keeps its private
tensors (all trained tensors under ``sharing.devices_keep_models``) and its optimisers' state
(for AdamW, two moments per trained tensor), never any of the base model. Where it is kept is
``federation.device_state``:

* ``memory``: in ``context.state``, as the bytes of one safetensors file in a ``ConfigRecord``;
* ``disk``: in one safetensors file per device under ``<run folder>/device_state/<method>/``
  (a phone's own storage), ``context.state`` naming the file. The driver's memory then stays
  flat however many devices have trained, and an evaluation reads the private tensors only.
* ``auto`` (the default): ``memory`` for a device whose state is at most :data:`AUTO_DISK_BYTES`,
  ``disk`` above it. A method that trains the whole base keeps two AdamW moments per base weight
  (1 GiB per device for SmolLM2-135M in float32), which the driver would otherwise hold for
  every device that trained.

A real device (Flower's deployment engine) always keeps them on its own disk, one file per round it
trained, under its ``state-dir`` (:mod:`~ondevice_moe.federation.device_snapshots`).

Either way the tensors are stored as they are and the rest of the optimisers' state (steps,
hyperparameters, the scheduler) as JSON beside them: no pickle (``torch.save`` of an optimiser's
state, per tensor, costs more than restoring the model it belongs to).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, RecordDict

from ondevice_moe.federation.job import Job
from ondevice_moe.names import folder_name

STATE_KEY = "device-state"
METHOD_KEY = "device-method"  # the method whose state ``context.state`` holds
PRIVATE = "private/"
OPTIMIZER = "optimizer"
AUTO_DISK_BYTES = 64 * 2**20  # ``device_state: auto`` keeps a larger state on disk


def enter_method(job: Job, context: Context) -> None:
    """Make ``context.state`` the state of ``job``'s method. ``ondevice-moe finetune`` runs a recipe's
    methods one after another on the same simulated devices, so a device's first message of the next
    method finds the last method's state: it is dropped, and the device starts the method afresh."""
    held = context.state.get(METHOD_KEY)
    if held is not None and held["name"] == job.method.name:
        return
    if held is not None:
        for key in list(context.state.keys()):
            del context.state[key]
    context.state[METHOD_KEY] = ConfigRecord({"name": job.method.name})


def state_folder(job: Job) -> Path:
    """Where ``federation.device_state: disk`` keeps the method's devices' files."""
    return job.run_dir / "device_state" / folder_name(job.method.name)


def clear_state_folder(job: Job) -> None:
    """Remove the method's device files: once its run ends, the checkpoints hold what the devices learned."""
    folder = state_folder(job)
    shutil.rmtree(folder, ignore_errors=True)
    if folder.parent.is_dir() and not any(folder.parent.iterdir()):
        folder.parent.rmdir()


def save_device_state(job: Job, device: int, private: dict[str, torch.Tensor], optimizer: dict[str, Any],
                      state: RecordDict, server_round: int) -> None:
    """Keep ``private`` (tensor name → tensor) and ``optimizer`` (a trainer's optimiser state) for the
    device's next round, where ``federation.device_state`` says. A real device always keeps them on
    its own disk, one file per round it trained (:mod:`~ondevice_moe.federation.device_snapshots`):
    its Flower context, which passes through the SuperNode with every message, then names a file and
    carries no tensor."""
    from safetensors.torch import save, save_file

    tensors = {PRIVATE + name: tensor for name, tensor in private.items()}
    layout = json.dumps(_skeleton(optimizer, OPTIMIZER, tensors))
    tensors = {name: tensor.detach().contiguous() for name, tensor in tensors.items()}
    if job.on_device or _on_disk(job.recipe.federation.device_state, tensors):
        name = f"private-{server_round}.safetensors" if job.on_device else f"device_{device}.safetensors"
        path = state_folder(job) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        save_file(tensors, str(partial), metadata={"layout": layout})
        os.replace(partial, path)
        state[STATE_KEY] = ConfigRecord({"path": str(path)})
    else:
        state[STATE_KEY] = ConfigRecord({"tensors": save(tensors), "layout": layout})


def _on_disk(mode: str, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether ``federation.device_state: mode`` keeps these tensors in a file."""
    if mode == "auto":
        return sum(t.numel() * t.element_size() for t in tensors.values()) > AUTO_DISK_BYTES
    return mode == "disk"


def load_device_state(state: RecordDict, with_optimizer: bool) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The device's private tensors and (``with_optimizer``) optimiser state; nothing before its first round."""
    if STATE_KEY not in state:
        return {}, None
    record = state[STATE_KEY]
    if "path" in record:
        from safetensors import safe_open

        with safe_open(str(record["path"]), framework="pt") as handle:
            layout = handle.metadata()["layout"]
            stored = handle.keys()  # a safetensors file is no mapping: it lists its names
            tensors = {name: handle.get_tensor(name) for name in stored if with_optimizer or name.startswith(PRIVATE)}
    else:
        from safetensors.torch import load

        layout = str(record["layout"])
        tensors = load(bytes(record["tensors"]))
    private = {name.removeprefix(PRIVATE): t for name, t in tensors.items() if name.startswith(PRIVATE)}
    return private, _rebuild(json.loads(layout), tensors) if with_optimizer else None


def private_tensors(state: RecordDict) -> dict[str, torch.Tensor]:
    """The private tensors a device keeps (empty before its first round)."""
    return load_device_state(state, with_optimizer=False)[0]


def _skeleton(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON, each tensor moved into ``tensors`` under its path and named in its place
    (dictionaries as item lists, so an optimiser's integer parameter indices stay integers)."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value
        return {"tensor": key}
    if isinstance(value, dict):
        return {"items": [[k, _skeleton(v, f"{key}/{k}", tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"list": [_skeleton(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]}
    return {"value": value}


def _rebuild(skeleton: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    """The value :func:`_skeleton` took apart (tuples come back as lists)."""
    if "tensor" in skeleton:
        return tensors[skeleton["tensor"]]
    if "items" in skeleton:
        return {k: _rebuild(v, tensors) for k, v in skeleton["items"]}
    if "list" in skeleton:
        return [_rebuild(v, tensors) for v in skeleton["list"]]
    return skeleton["value"]
