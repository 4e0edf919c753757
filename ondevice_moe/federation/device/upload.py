"""What leaves the device: the shared, trained tensors the method's sharing policy lets travel, and the
private state kept home between rounds (:mod:`~ondevice_moe.federation.device_state`)."""

from __future__ import annotations

import torch
from flwr.app import RecordDict
from torch import nn

from ondevice_moe.federation import device_state
from ondevice_moe.federation.device.base import job_base_structure
from ondevice_moe.federation.device.model import build_model
from ondevice_moe.federation.job import Job
from ondevice_moe.methods import Method, Role
from ondevice_moe.routing.lifecycle import routed_upload
from ondevice_moe.training import DeviceTrainer, trainable_state


def save_private_state(job: Job, device: int, trainer: DeviceTrainer, state: RecordDict, server_round: int) -> None:
    """Keep private tensors (all trained tensors with ``sharing.devices_keep_models``) and
    optimiser state after ``server_round`` for the device's next round
    (:mod:`~ondevice_moe.federation.device_state`)."""
    keep_all = trainer.method.sharing.devices_keep_models
    roles = trainer.method.roles(trainer.model)
    private = {n: t for n, t in trainable_state(trainer.model).items() if keep_all or roles[n] is Role.PRIVATE}
    device_state.save_device_state(job, device, private, trainer.optimizer_state(), state, server_round)


def travelling(method: Method, model: nn.Module) -> set[str]:
    """The names of ``model``'s tensors that may leave the device: shared (:meth:`Method.roles`) and
    trained by the method."""
    return {name for name, role in method.roles(model).items() if role is Role.SHARED and method.is_trainable(name)}


def shared_state(trainer: DeviceTrainer) -> dict[str, torch.Tensor]:
    """Copies of the tensors that may leave the device: shared and trainable."""
    leaving = travelling(trainer.method, trainer.model)
    return {name: tensor.clone() for name, tensor in trainable_state(trainer.model).items() if name in leaving}


def upload_reference(job: Job, device: int) -> dict[str, torch.Tensor]:
    """Names, shapes and dtypes of every tensor the device may upload (whatever its usage),
    as empty tensors on the meta device: what the server checks an update against. Built on the
    base's structure (:func:`job_base_structure`): the server reads no weights and needs no accelerator."""
    model = build_model(job, device, base=job_base_structure(job))
    leaving = travelling(job.method, model)
    one = {name: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
           for name, tensor in trainable_state(model).items() if name in leaving}
    return job.method.procedure.upload_reference(one)


def upload(job: Job, trainer: DeviceTrainer) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """What the device sends after a round: its shared tensors (where ``sharing.selected_only``, those
    of the experts its routers chose, with the records they send:
    :func:`~ondevice_moe.routing.lifecycle.routed_upload`), then whatever the method's procedure
    changes or adds (:meth:`~ondevice_moe.methods.procedure.Procedure.upload`)."""
    tensors, records = shared_state(trainer), {}
    if job.method.sharing.selected_only:
        tensors, records = routed_upload(trainer.model, tensors)
    return job.method.procedure.upload(trainer, tensors, records)
