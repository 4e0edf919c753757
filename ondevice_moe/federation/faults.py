"""Simulated unreliable devices (recipe ``federation.faults``), as a Flower client mod.

The mod wraps the ClientApp's training handler. For each fault of the recipe
that names this device (its ``partition-id``) and is active in the message's
round it makes the device

* ``crash``: raise instead of training (the server receives an error reply);
* ``slow``: sleep ``delay_s`` seconds before training (past
  ``federation.reply_timeout_s`` the server stops waiting for it);
* ``nan``: train, then upload non-finite values;
* ``wrong-shape``: train, then upload a tensor with one element too many.

Evaluation messages pass untouched: a fault models a device failing during
local training, so a faulty federation can still be scored on every user.
"""

from __future__ import annotations

import time

import torch
from flwr.app import Context, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable

from ondevice_moe.federation.job import job_from_context
from ondevice_moe.federation.wire import pack, unpack
from ondevice_moe.recipe import FaultSection

FAULT_TENSOR = "fault/extra"  # the name a corrupted upload uses when the device shares nothing


class SimulatedCrash(RuntimeError):
    """The error a ``crash`` fault raises on the device."""


def fault_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Apply this device's active faults to a training message (a Flower ``Mod``)."""
    if msg.metadata.message_type.split(".")[0] != MessageType.TRAIN:
        return call_next(msg, context)
    device = int(context.node_config["partition-id"])
    server_round = int(msg.content["config"]["server-round"])
    faults = active_faults(job_from_context(context).recipe.federation.faults, device, server_round)
    kinds = {fault.kind for fault in faults}
    if "crash" in kinds:
        raise SimulatedCrash(f"simulated crash of device {device} in round {server_round}")
    for fault in faults:
        if fault.kind == "slow":
            time.sleep(fault.delay_s)
    reply = call_next(msg, context)
    if kinds & {"nan", "wrong-shape"} and not reply.has_error():
        tensors = unpack(reply.content["arrays"])
        if "nan" in kinds:
            tensors = poison(tensors)
        if "wrong-shape" in kinds:
            tensors = misshape(tensors)
        reply.content["arrays"] = pack(tensors)
    return reply


def active_faults(faults: list[FaultSection], device: int, server_round: int) -> list[FaultSection]:
    return [fault for fault in faults if fault.device == device and fault.active(server_round)]


def poison(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The upload with its first floating-point tensor (by name) filled with NaN: under
    ``federation.transport: int8`` a tensor's scale, which the tensor decodes to NaN by."""
    name = min((n for n, t in tensors.items() if t.is_floating_point()), default=FAULT_TENSOR)
    like = tensors.get(name, torch.zeros(1))
    return {**tensors, name: torch.full_like(like, float("nan"))}


def misshape(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The upload with its first tensor (by name) flattened and one element longer."""
    name = min(tensors, default=FAULT_TENSOR)
    like = tensors.get(name, torch.zeros(1))
    return {**tensors, name: torch.zeros(like.numel() + 1, dtype=like.dtype)}
