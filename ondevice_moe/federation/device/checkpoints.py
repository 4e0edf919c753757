"""The checkpoints a finished method leaves: each device's model, the server's (cluster centres), and the
record that a device finished."""

from __future__ import annotations

import torch
from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.federation.device.model import shape_mismatch
from ondevice_moe.federation.job import Job
from ondevice_moe.names import folder_name
from ondevice_moe.safe_files import save_tensors, write_text
from ondevice_moe.training import trainable_state


def checkpoint_path(job: Job, device: int):
    return job.run_dir / "checkpoints" / folder_name(job.method.name) / f"device_{device}.safetensors"


def save_checkpoint(job: Job, device: int, model: nn.Module) -> None:
    """Write everything the device learned (shared and private) after the last round."""
    path = checkpoint_path(job, device)
    save_tensors(path, {name: tensor.contiguous() for name, tensor in trainable_state(model).items()})


def record_device_finished(job: Job, device: int) -> None:
    """On a real device, make its run folder one that ``eval`` and ``export`` open: the recipe, which
    device it is (``node.json``) and a ``done`` record for the method, beside the checkpoint."""
    import yaml

    from ondevice_moe.federation.node import NODE_FILE
    from ondevice_moe.report import MetricsLog

    folder = job.run_dir
    write_text(folder / "recipe.yaml", yaml.safe_dump(job.recipe.model_dump(mode="json"), sort_keys=False))
    write_text(folder / NODE_FILE, job.node.to_json())
    log = MetricsLog(folder / "metrics.jsonl")
    log.discard(job.method.name)
    log.write({"method": job.method.name, "kind": "done", "device": device})


def server_checkpoint_path(job: Job):
    return job.run_dir / "checkpoints" / folder_name(job.method.name) / "server.safetensors"


def save_server_checkpoint(job: Job, tensors: dict[str, torch.Tensor]) -> None:
    """Write what the server holds after the last round and no device does (FedSoft's centres)."""
    path = server_checkpoint_path(job)
    save_tensors(path, {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()})


def server_models_of(job: Job) -> dict[int, dict[str, torch.Tensor]]:
    """The models the server of a finished run formed and kept (FedSoft's, IFCA's or FedEM's cluster
    centres; one no client ever contributed to is not among them); a method whose server keeps none
    or a missing file ends with a clear message."""
    from safetensors.torch import load_file

    if not job.method.procedure.server_keeps_models:
        raise UserError(f"method '{job.method.name}' has no cluster centres", "export a fedsoft, ifca or fedem method")
    path = server_checkpoint_path(job)
    if not path.is_file():
        raise UserError(f"no centres for method '{job.method.name}': {path} is missing",
                        "rerun the recipe with this version of ondevice-moe (earlier runs did not keep the centres)")
    return job.method.procedure.server_models(load_file(str(path)))


def load_server_model(job: Job, index: int, model: nn.Module) -> None:
    """Load the server's model ``index`` of a finished run (FedSoft's, IFCA's or FedEM's cluster centre)
    into ``model``; a method without one, one the server never formed or a missing file ends with a
    clear message."""
    kept = server_models_of(job)
    if index not in kept:
        raise UserError(f"centre {index} was never formed in this run", f"use one of: {sorted(kept)}")
    model.load_state_dict(kept[index], strict=False)


def load_checkpoint(job: Job, device: int, model: nn.Module) -> None:
    """Load a device's checkpoint; a missing or corrupt file ends with a clear message."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = checkpoint_path(job, device)
    if not path.is_file() and job.recipe.data is not None and job.recipe.data.brought_by_devices:
        raise UserError(f"{job.run_dir} is the server's folder of a run on real devices: each device keeps its own "
                        "model", "run it on the device, on its folder <state-dir>/<recipe name> (docs/deployment.md)")
    if not path.is_file():
        raise UserError(f"no checkpoint for method '{job.method.name}', device {device}: {path} is missing",
                        "finish the run first (run the same `ondevice-moe finetune` command again to resume)")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise UserError(f"checkpoint {path} is unreadable ({error})",
                        "delete it and the method's lines in metrics.jsonl, then rerun to retrain") from None
    own = model.state_dict()
    unexpected = set(state) - set(own)
    if unexpected:
        raise UserError(f"checkpoint {path} does not fit the recipe's model (e.g. {sorted(unexpected)[:2]})",
                        "evaluate it with the recipe.yaml it was trained with")
    mismatch = shape_mismatch(own, state)
    if mismatch:
        raise UserError(f"checkpoint {path} does not fit the recipe's model: {mismatch}",
                        "evaluate it with the recipe.yaml it was trained with")
    model.load_state_dict(state, strict=False)
