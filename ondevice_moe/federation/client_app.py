"""The Flower ClientApp: one device's side of every method.

``train``: rebuild the device's model from the private state in ``context.state`` and the
server's shared tensors (loaded, or only read where the method's procedure reads them: PCL's
peers, FedSoft's centres), let the method's procedure begin, run and end the round
(:class:`~ondevice_moe.methods.procedure.Procedure`), keep the private part, and reply with the
shared part only, with the records the server weighs it by. ``evaluate``: the method's test of
the device's model (:mod:`~ondevice_moe.federation.evaluation`): for language modelling, test
perplexity in distribution (the user's own test split) and out of distribution (the union of all
users' test splits); for classification, the task's metric on the client's own test split.
``query``: the device's index (``partition-id``), so the server knows which node holds which user.
Shared tensors travel encoded both ways (``federation.transport``,
:mod:`ondevice_moe.federation.transport`): the device decodes what it receives and encodes what it sends.
Under ``privacy`` the update of the shared tensors is clipped and noised before it is
encoded (:mod:`ondevice_moe.federation.privacy`). Simulated faults (``federation.faults``)
wrap training as a client mod; Flower's SecAgg+ (``federation.secure_aggregation``) wraps
both as the outer mod (:mod:`ondevice_moe.federation.secure_aggregation`).
"""

from __future__ import annotations

import os
import secrets
import time
import zlib
from logging import ERROR

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore import log as flwr_log

from ondevice_moe.federation import device as dev
from ondevice_moe.federation.device_state import enter_method, persist_context, resume_context
from ondevice_moe.federation.evaluation import evaluate_device, prepare_test
from ondevice_moe.federation.faults import fault_mod
from ondevice_moe.federation.job import Job, device_job, message_method
from ondevice_moe.federation.node import REFUSED
from ondevice_moe.federation.privacy import noise_generator, privatize
from ondevice_moe.federation.secure_aggregation import secure_aggregation_mod
from ondevice_moe.federation.transport import decode, encode
from ondevice_moe.federation.wire import pack, unpack

app = ClientApp(mods=[secure_aggregation_mod, fault_mod])


def _device_index(context: Context) -> int:
    return int(context.node_config["partition-id"])


def _stored_state(job: Job, context: Context) -> dict[str, int]:
    """The device's state for the job's method: a device whose SuperNode restarted picks up the private
    state it kept on its own disk (:func:`~ondevice_moe.federation.device_state.resume_context`;
    ``resumed_round`` says from which round); one that served another method drops that method's."""
    resumed = resume_context(job, context)
    enter_method(job, context)
    return {"resumed_round": resumed} if resumed else {}


def _received(job: Job, msg: Message) -> dict[str, torch.Tensor] | None:
    """The shared tensors the server sent, unpacked and decoded (``federation.transport``); ``None``
    where it sent none."""
    arrays = msg.content.array_records.get("arrays")
    if arrays is None or len(arrays) == 0:
        return None
    return decode(unpack(arrays), job.recipe.federation.transport)


NOISE_SECRET = "noise-secret"


def noise_seed(job: Job, context: Context) -> int:
    """The seed of this device's privacy noise. In the simulation, the recipe's: a rerun repeats it. On a
    real device, a secret it draws once and keeps in its own state (on its disk with the rest, so a
    restarted device repeats its noise): the server holds the recipe, and with the recipe's seed it
    could regenerate the noise and take it off the update."""
    if not job.on_device:
        return job.recipe.seed
    if NOISE_SECRET not in context.state:
        context.state[NOISE_SECRET] = ConfigRecord({"seed": secrets.randbits(62)})
    return int(context.state[NOISE_SECRET]["seed"])


@app.query()
def identify(msg: Message, context: Context) -> Message:
    """Tell the server which device (user or client index) this node is; when the server refuses
    the node (another holds its partition-id), say why in the device's own log."""
    config = msg.content.config_records.get("config")
    if config is not None and REFUSED in config:
        flwr_log(ERROR, "the server refused this device: %s; fix: give each SuperNode its own partition-id",
                 config[REFUSED])
    return Message(RecordDict({"metrics": MetricRecord({"device": _device_index(context)})}), reply_to=msg)


def handler_figures(started: float) -> dict[str, float]:
    """``handler_s``: seconds since ``started`` (this handler's own work); ``worker``: the
    process that served it, so the server can tell clients that ran in parallel from clients one
    worker served in turn; ``base_loads``: how often that process has loaded a base model (once,
    however many devices and rounds it serves). The server turns them into each round's
    ``round`` record (:class:`~ondevice_moe.federation.strategy.SlotStrategy`)."""
    return {"handler_s": time.perf_counter() - started, "worker": os.getpid(),
            "base_loads": dev.base_model.cache_info().misses}


def seed_dropout(seed: int) -> None:
    """``torch.manual_seed`` without its cost where there is no CUDA: it also queues a lazy CUDA seeding
    that captures a stack trace, about a millisecond per message, a quarter of a small model's round."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


@app.train()
def train(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    job = device_job(context, message_method(msg))
    device = _device_index(context)
    resumed = _stored_state(job, context)
    arrays = _received(job, msg)
    procedure = job.method.procedure
    server_round = int(msg.content["config"]["server-round"])
    trainer = dev.restore_trainer(job, device, arrays if procedure.loads_received else None, context.state)
    chosen = procedure.begin_round(dev.JobDevice(job, device, context.state), trainer, arrays, server_round)
    privacy = job.recipe.privacy
    start = dev.travelling_state(job, trainer) if privacy.enabled else {}
    seed = dev.device_seed(job, device)
    # Dropout draws from the global generator: seed it per device and round so a
    # run gives the same numbers whichever worker process serves the device.
    seed_dropout(zlib.crc32(f"{seed}:{server_round}".encode()))
    dev.start_round(trainer.model)
    metrics, examples = dev.run_local_procedure(job, device, trainer, seed)
    dev.save_private_state(job, device, trainer, context.state)
    persist_context(job, context, server_round)
    metrics.update({**chosen, **resumed, "device": device, "num-examples": examples})
    tensors, records = dev.upload(job, trainer)
    if privacy.enabled:
        tensors, figures = privatize(start, tensors, privacy, noise_generator(noise_seed(job, context), device,
                                                                              server_round))
        metrics.update(figures)
    content = RecordDict({"arrays": pack(encode(tensors, job.recipe.federation.transport))})
    for key, values in records.items():
        content[key] = MetricRecord(values)
    content["metrics"] = MetricRecord({**metrics, **handler_figures(started)})
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    job = device_job(context, message_method(msg))
    device = _device_index(context)
    _stored_state(job, context)
    arrays = _received(job, msg)
    loads = job.method.procedure.loads_received
    model = dev.restore_model(job, device, arrays if loads else None, context.state)
    scores = prepare_test(job, device, model, None if loads else arrays, context.state)
    metrics = {**evaluate_device(job, device, model, context.state), **scores}
    metrics["device"] = device
    if msg.content["config"].get("final", False) and job.method.trains:
        dev.save_checkpoint(job, device, model)
        if job.on_device:
            dev.record_device_finished(job, device)
    return Message(RecordDict({"metrics": MetricRecord({**metrics, **handler_figures(started)})}), reply_to=msg)
