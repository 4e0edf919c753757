"""Simulated unreliable and lying devices (recipe ``federation.faults``), as a Flower client mod.

The mod wraps the ClientApp's training handler. For each fault of the recipe
that names this device (its ``partition-id``) and is active in the message's
round it makes the device

* ``crash``: raise instead of training (the server receives an error reply);
* ``slow``: sleep ``delay_s`` seconds before training (past
  ``federation.reply_timeout_s`` the server stops waiting for it);
* ``nan``: train, then upload non-finite values;
* ``wrong-shape``: train, then upload a tensor with one element too many;

and, as a Byzantine device that trains and then lies (Blanchard et al. 2017; Fang et al. 2020):

* ``sign-flip``: send ``w₀ − scale·(w − w₀)``, the model it received (``w₀``) moved the other way by
  ``scale`` times its update (the model itself, negated and scaled, before the server sends one);
* ``constant``: send ``value`` in every coordinate;
* ``noise``: send ``w + N(0, std²)``, seeded by the device and the round;
* ``stale``: send, every round, what it sent in the first round the fault was active (kept in its
  Flower context);
* ``inflated-count``: claim ``examples`` training examples;
* ``label-flip``: train with class ``c`` read as ``C − 1 − c`` (``device.train_steps``; the data is
  the device's, so the fault lives where it reads it).

A lying device's upload is well formed: it passes the server's shape, dtype and finiteness checks,
and only the aggregation (``federation.aggregation``) and the bound on claimed example counts
(:mod:`ondevice_moe.federation.strategy`) stand between it and the global model.
Evaluation messages pass untouched: a fault models a device failing or lying during local
training, so a faulty federation can still be scored on every user.
"""

from __future__ import annotations

import time
import zlib

import torch
from flwr.app import ConfigRecord, Context, Message, MessageType
from flwr.clientapp.typing import ClientAppCallable

from ondevice_moe.federation.device_state import state_folder
from ondevice_moe.federation.job import Job, device_job, job_from_context, message_method
from ondevice_moe.federation.wire import pack, unpack
from ondevice_moe.recipe import FaultSection
from ondevice_moe.server_rules.transport import decode, encode

FAULT_TENSOR = "fault/extra"  # the name a corrupted upload uses when the device shares nothing
FORGED = ("sign-flip", "constant", "noise", "stale")  # faults that rewrite the upload's values
STALE_KEY = "fault-stale"  # in the device's context: the upload a ``stale`` device replays
STALE_FILE = "fault-stale.safetensors"  # on a real device, in its state folder


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
    if reply.has_error():
        return reply
    forged = [fault for fault in faults if fault.kind in FORGED]
    if forged:
        job = device_job(context, message_method(msg))
        reply.content["arrays"] = pack(forge(forged, reply, msg, context, job, device, server_round))
    for fault in faults:
        if fault.kind == "inflated-count":
            reply.content["metrics"]["num-examples"] = fault.examples
    if kinds & {"nan", "wrong-shape"}:
        tensors = unpack(reply.content["arrays"])
        if "nan" in kinds:
            tensors = poison(tensors)
        if "wrong-shape" in kinds:
            tensors = misshape(tensors)
        reply.content["arrays"] = pack(tensors)
    return reply


def active_faults(faults: list[FaultSection], device: int, server_round: int) -> list[FaultSection]:
    return [fault for fault in faults if fault.device == device and fault.active(server_round)]


def forge(faults: list[FaultSection], reply: Message, msg: Message, context: Context, job: Job, device: int,
          server_round: int) -> dict[str, torch.Tensor]:
    """The upload a lying device sends instead of its own, encoded as the recipe's transport sends it."""
    transport = job.recipe.federation.transport
    sent = decode(unpack(reply.content["arrays"]), transport)
    arrays = msg.content.array_records.get("arrays")
    received = decode(unpack(arrays), transport) if arrays is not None and len(arrays) else {}
    for fault in faults:
        sent = lie(fault, sent, received, context, job, device, server_round)
    return encode(sent, transport)


def lie(fault: FaultSection, sent: dict[str, torch.Tensor], received: dict[str, torch.Tensor], context: Context,
        job: Job, device: int, server_round: int) -> dict[str, torch.Tensor]:
    """What a device with ``fault`` sends for its honest upload ``sent``, having received ``received``."""
    floating = {name: tensor for name, tensor in sent.items() if tensor.is_floating_point()}
    if fault.kind == "sign-flip":
        lied = {name: received[name] - fault.scale * (t - received[name]) if name in received else -fault.scale * t
                for name, t in floating.items()}
    elif fault.kind == "constant":
        lied = {name: torch.full_like(t, fault.value) for name, t in floating.items()}
    elif fault.kind == "noise":
        generator = torch.Generator().manual_seed(zlib.crc32(f"noise:{device}:{server_round}".encode()))
        lied = {name: t + fault.std * torch.randn(t.shape, generator=generator, dtype=t.dtype)
                for name, t in floating.items()}
    else:  # stale: what it sent the first time
        lied = replayed(floating, context, job)
    return {**sent, **lied}


def replayed(tensors: dict[str, torch.Tensor], context: Context, job: Job) -> dict[str, torch.Tensor]:
    """The upload a ``stale`` device first sent, in place of ``tensors``: kept in its Flower context in the
    simulation, and on a real device in its state folder (its context comes back from disk each round)."""
    from safetensors.torch import load, save

    if job.on_device:
        path = state_folder(job) / STALE_FILE
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(save({name: t.contiguous() for name, t in tensors.items()}))
        kept = load(path.read_bytes())
    else:
        if STALE_KEY not in context.state:
            context.state[STALE_KEY] = ConfigRecord({"tensors": save({n: t.contiguous() for n, t in tensors.items()})})
        kept = load(bytes(context.state[STALE_KEY]["tensors"]))
    return {name: kept.get(name, tensor) for name, tensor in tensors.items()}


def flips_labels(faults: list[FaultSection], device: int, server_round: int) -> bool:
    """Whether the device trains on flipped classes this round (a ``label-flip`` fault)."""
    return any(fault.kind == "label-flip" for fault in active_faults(faults, device, server_round))


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
