"""The device's model: the base with its layout attached, rebuilt each round from the server's shared tensors
and the device's own private state."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from flwr.app import RecordDict
from torch import nn

from ondevice_moe.federation import device_state
from ondevice_moe.federation.device.base import job_base_model
from ondevice_moe.federation.job import Job
from ondevice_moe.layout import attach_layout
from ondevice_moe.layout.fused import fuse_experts
from ondevice_moe.methods import Method
from ondevice_moe.models.checkpointing import enable_activation_checkpointing
from ondevice_moe.models.heads import head_paths
from ondevice_moe.training import DeviceTrainer


def build_model(job: Job, device: int, base: nn.Module | None = None, seed: int | None = None) -> nn.Module:
    """The device's model: the shared base (``base``, or the recipe's model) with this device's
    experts (and task head) attached, initialised from ``seed`` (default: the recipe's)."""
    layout = job.method.layouts[device]
    base = job_base_model(job).model if base is None else base
    whole = job.method.procedure.full_finetune
    if whole:
        base = copy.deepcopy(base)
        if layout is None:
            return base.requires_grad_(True)
    if layout is None:
        return base
    heads = () if job.recipe.is_language_modelling else head_paths(base)
    model = attach_layout(base, layout, seed=job.recipe.seed if seed is None else seed, user=device, own=heads)
    if job.recipe.training.fused_experts:
        fuse_experts(model)
    if whole:  # FLoRAL trains the base u with its adaptors (Alg. 1 line 8)
        return model.requires_grad_(True)
    for path in heads:
        model.get_submodule(path).requires_grad_(True)
    return model


def restore_model(job: Job, device: int, shared: Mapping[str, torch.Tensor] | None,
                  state: RecordDict) -> nn.Module:
    """The device's model to evaluate: fresh experts, then its private tensors, then the server's."""
    model = build_model(job, device)
    _load_tensors(job.method, model, device_state.private_tensors(state), shared)
    return model


def restore_trainer(job: Job, device: int, shared: Mapping[str, torch.Tensor] | None, state: RecordDict
                    ) -> DeviceTrainer:
    """Rebuild the device's trainer: fresh experts, then private state, then the server's tensors."""
    model = build_model(job, device)
    if job.recipe.model.activation_checkpointing:
        enable_activation_checkpointing(model)
    trainer = DeviceTrainer(model, job.method, job.training)
    private, optimizer = device_state.load_device_state(state, with_optimizer=True)
    _load_tensors(job.method, model, private, shared)
    if optimizer is not None:
        trainer.load_optimizer_state(optimizer)
    return trainer


def _load_tensors(method: Method, model: nn.Module, private: dict[str, torch.Tensor],
                  shared: Mapping[str, torch.Tensor] | None) -> None:
    """Load a device's private tensors, then the server's shared ones (fitted to the model by the
    method's procedure), into ``model``."""
    tensors = dict(private)
    if shared:
        tensors.update(shared)
    if tensors:
        tensors = method.procedure.fit_received(model, tensors)
        check_received(model.state_dict(), tensors)
        model.load_state_dict(tensors, strict=False)


def shape_mismatch(own: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> str | None:
    """The first tensor of ``loaded`` whose shape differs from ``own``'s, said in words, or ``None``."""
    for name, tensor in loaded.items():
        if name in own and tensor.shape != own[name].shape:
            return f"{name} has shape {list(tensor.shape)}; the model's has {list(own[name].shape)}"
    return None


def check_received(own: dict[str, torch.Tensor], received: dict[str, torch.Tensor]) -> None:
    """A device trusts the server no further than it must: every tensor it loads must be one it
    holds, of the same shape and kind (floating point or not), and finite; else a ``ValueError``
    naming the tensor, before anything is trained on it."""
    missing = set(received) - set(own)
    if missing:
        raise ValueError(f"received tensors this device does not hold: {sorted(missing)[:3]}")
    mismatch = shape_mismatch(own, received)
    if mismatch:
        raise ValueError(f"received tensor {mismatch}")
    for name, tensor in received.items():
        mine = own[name]
        if tensor.is_floating_point() != mine.is_floating_point():
            raise ValueError(f"received tensor {name} is {tensor.dtype}; this device's is {mine.dtype}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"received tensor {name} holds non-finite values; this device will not train on it")
