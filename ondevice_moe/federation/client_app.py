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
On a real device every message restores the state the round asks for from the device's own disk
(:mod:`~ondevice_moe.federation.device_snapshots`), so a run that its server continues after a crash
goes on from the right round, and an error that leaves the device names no path on it
(:func:`device_side`).
Shared tensors travel encoded both ways (``federation.transport``,
:mod:`ondevice_moe.server_rules.transport`): the device decodes what it receives and encodes what it sends.
Under ``privacy`` the update of the shared tensors is clipped and noised before it is
encoded (:mod:`ondevice_moe.federation.privacy`). Simulated faults (``federation.faults``)
wrap training as a client mod; Flower's SecAgg+ (``federation.secure_aggregation``) wraps
both as the outer mod (:mod:`ondevice_moe.federation.secure_aggregation`).
"""

from __future__ import annotations

import functools
import os
import time
import traceback
import zlib
from collections.abc import Callable
from logging import ERROR

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore import log as flwr_log

from ondevice_moe.errors import UserError, failure_line
from ondevice_moe.federation import device as dev
from ondevice_moe.federation import device_snapshots as snapshots
from ondevice_moe.federation.device_state import enter_method
from ondevice_moe.federation.evaluation import evaluate_device, prepare_test
from ondevice_moe.federation.faults import fault_mod
from ondevice_moe.federation.job import Job, device_job, message_method, submitted
from ondevice_moe.federation.node import REFUSED, node_facts
from ondevice_moe.federation.privacy import noise_generator, privatize
from ondevice_moe.federation.redaction import path_free
from ondevice_moe.federation.riding import EVALUATE_ROUND, EVALUATION
from ondevice_moe.federation.secure_aggregation import secure_aggregation_mod
from ondevice_moe.federation.wire import pack, unpack
from ondevice_moe.routing.lifecycle import begin_round
from ondevice_moe.server_rules.transport import decode, encode

app = ClientApp(mods=[secure_aggregation_mod, fault_mod])


def _device_index(context: Context) -> int:
    return int(context.node_config["partition-id"])


RUN_KEY = "run-key"  # in a message's config: the run it belongs to, the same in each of its Flower runs


def run_key(msg: Message, context: Context) -> str:
    """The run a message belongs to: the key the server sends, else (an older server) the Flower run."""
    config = msg.content.config_records.get("config")
    return str(config[RUN_KEY]) if config is not None and RUN_KEY in config else f"flower-{context.run_id}"


def _stored_state(job: Job, context: Context, msg: Message, upto: int) -> dict[str, int]:
    """The device's state for the job's method as it stood after round ``upto``. A real device restores
    it from its own disk every message (:func:`~ondevice_moe.federation.device_snapshots.restore`;
    ``resumed_round`` says from which round, when its context had to come back from there); in the
    simulation the context holds it, and one that served another method drops that method's."""
    resumed = 0
    if job.on_device:
        key = run_key(msg, context)
        snapshots.enter_run(job, key)
        restored, cold = snapshots.restore(job, context, key, upto)
        resumed = restored if cold else 0
    enter_method(job, context)
    return {"resumed_round": resumed} if resumed else {}


def device_side(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    """On a real device, an error leaves the device without its paths (:func:`~ondevice_moe.federation.
    redaction.path_free`); its own log keeps the whole error and its traceback."""

    @functools.wraps(handler)
    def handle(msg: Message, context: Context) -> Message:
        try:
            return handler(msg, context)
        except Exception as error:
            if not submitted(context.run_config):
                raise
            flwr_log(ERROR, "this device failed a %s message: %s", msg.metadata.message_type,
                     "".join(traceback.format_exception(error)))
            try:
                node = node_facts(context.node_config)
            except UserError:
                node = None
            fix = error.fix if isinstance(error, UserError) and error.fix else "the device's own log has the detail"
            raise UserError(path_free(failure_line(error), node), path_free(fix, node)) from None

    return handle


def _received(job: Job, msg: Message) -> dict[str, torch.Tensor] | None:
    """The shared tensors the server sent, unpacked and decoded (``federation.transport``); ``None``
    where it sent none."""
    arrays = msg.content.array_records.get("arrays")
    if arrays is None or len(arrays) == 0:
        return None
    return decode(unpack(arrays), job.recipe.federation.transport)



def noise_seed(job: Job, context: Context, msg: Message) -> int:
    """The seed of this device's privacy noise. In the simulation, the recipe's: a rerun repeats it. On a
    real device, a secret it draws once per run and keeps on its own disk (so a restarted device, or a
    round sent again after the server's crash, repeats its noise): the server holds the recipe, and
    with the recipe's seed it could regenerate the noise and take it off the update."""
    if not job.on_device:
        return job.recipe.seed
    return snapshots.noise_secret(job, run_key(msg, context))


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
@device_side
def train(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    job = device_job(context, message_method(msg))
    device = _device_index(context)
    server_round = int(msg.content["config"]["server-round"])
    resumed = _stored_state(job, context, msg, server_round - 1)
    arrays = _received(job, msg)
    evaluation = _riding_evaluation(job, device, msg, context, arrays, server_round)
    procedure = job.method.procedure
    trainer = dev.restore_trainer(job, device, arrays if procedure.loads_received else None, context.state)
    chosen = procedure.begin_round(dev.JobDevice(job, device, context.state), trainer, arrays, server_round)
    privacy = job.recipe.privacy
    start = dev.shared_state(trainer) if privacy.enabled else {}  # where the round's update starts from
    seed = dev.device_seed(job, device)
    # Dropout draws from the global generator: seed it per device and round so a
    # run gives the same numbers whichever worker process serves the device.
    seed_dropout(zlib.crc32(f"{seed}:{server_round}".encode()))
    begin_round(trainer.model)
    metrics, examples = dev.run_local_procedure(job, device, trainer, seed, server_round)
    dev.save_private_state(job, device, trainer, context.state, server_round)
    if job.on_device:
        snapshots.keep(job, context, run_key(msg, context), server_round)
    metrics.update({**chosen, **resumed, "device": device, "num-examples": examples})
    tensors, records = dev.upload(job, trainer)
    if privacy.enabled:
        tensors, figures = privatize(start, tensors, privacy, noise_generator(noise_seed(job, context, msg), device,
                                                                              server_round))
        metrics.update(figures)
    content = RecordDict({"arrays": pack(encode(tensors, job.recipe.federation.transport))})
    for key, values in records.items():
        content[key] = MetricRecord(values)
    if evaluation is not None:
        content[EVALUATION] = MetricRecord(evaluation)
    content["metrics"] = MetricRecord({**metrics, **handler_figures(started)})
    return Message(content, reply_to=msg)


def _riding_evaluation(job: Job, device: int, msg: Message, context: Context,
                       arrays: dict[str, torch.Tensor] | None, server_round: int) -> dict[str, float] | None:
    """The evaluation of the previous round that rides on this training message, where the server
    asks for one (:mod:`~ondevice_moe.federation.riding`): what :func:`evaluate` would have replied to
    that round's own evaluation message, from the same state and tensors."""
    config = msg.content["config"]
    if EVALUATE_ROUND not in config:
        return None
    if int(config[EVALUATE_ROUND]) != server_round - 1:
        raise UserError(f"the server asked this device to evaluate round {config[EVALUATE_ROUND]} with round "
                        f"{server_round}'s training, which follows round {server_round - 1}",
                        "run the same ondevice-moe version on the server and the devices")
    return _tested(job, device, arrays, context)[1]


def _tested(job: Job, device: int, arrays: dict[str, torch.Tensor] | None,
            context: Context) -> tuple[torch.nn.Module, dict[str, float]]:
    """The device's model with the server's ``arrays``, and the method's test of it (its records)."""
    loads = job.method.procedure.loads_received
    model = dev.restore_model(job, device, arrays if loads else None, context.state)
    scores = prepare_test(job, device, model, None if loads else arrays, context.state)
    return model, {**evaluate_device(job, device, model, context.state), **scores, "device": device}


@app.evaluate()
@device_side
def evaluate(msg: Message, context: Context) -> Message:
    started = time.perf_counter()
    job = device_job(context, message_method(msg))
    device = _device_index(context)
    _stored_state(job, context, msg, int(msg.content["config"]["server-round"]))
    model, metrics = _tested(job, device, _received(job, msg), context)
    if msg.content["config"].get("final", False) and job.method.trains:
        dev.save_checkpoint(job, device, model)
        if job.on_device:
            dev.record_device_finished(job, device)
    return Message(RecordDict({"metrics": MetricRecord({**metrics, **handler_figures(started)})}), reply_to=msg)
