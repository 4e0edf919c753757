"""The Flower ClientApp: one device's side of every method.

``train``: rebuild the device's model from the server's shared tensors and the
private state in ``context.state``, run the method's local procedure, keep the
private part, and reply with the shared part only (plus, for Hermes, each
uploaded expert's usage count). ``evaluate``: for language modelling, test
perplexity in distribution (the user's own test split) and out of
distribution (the union of all users' test splits); for classification, the
task's metric on the client's own test split.
"""

from __future__ import annotations

import zlib

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ondevice_moe.federation import device as dev
from ondevice_moe.federation.evaluation import evaluate_device
from ondevice_moe.federation.job import Job, job_from_context
from ondevice_moe.training import DeviceTrainer

app = ClientApp()


def _device_index(context: Context) -> int:
    return int(context.node_config["partition-id"])


@app.train()
def train(msg: Message, context: Context) -> Message:
    job = job_from_context(context)
    device = _device_index(context)
    trainer = dev.restore_trainer(job, device, msg.content.array_records.get("arrays"), context.state)
    seed = job.recipe.seed * 1000 + device
    # Dropout draws from the global generator: seed it per device and round so a
    # run gives the same numbers whichever worker process serves the device.
    torch.manual_seed(zlib.crc32(f"{seed}:{msg.content['config']['server-round']}".encode()))
    dev.start_round(trainer.model)
    if job.recipe.is_language_modelling:
        metrics, examples = _train_language_model(job, device, trainer, seed)
    else:
        metrics, examples = _train_classifier(job, device, trainer, seed)
    dev.save_private_state(trainer, context.state)
    metrics.update({"device": device, "num-examples": examples})
    content = RecordDict({"arrays": ArrayRecord(dev.shared_state(trainer)), "metrics": MetricRecord(metrics)})
    if job.method.upload_selected_only:
        shared = set(content["arrays"].keys())
        content["usage"] = MetricRecord({n: c for n, c in dev.expert_usage(trainer.model).items() if n in shared})
    return Message(content, reply_to=msg)


def _train_language_model(job: Job, device: int, trainer: DeviceTrainer, seed: int) -> tuple[dict, int]:
    # The centralized upper bound sees every user's batch at once (CoMiGS: 64 × 4).
    batch = job.recipe.data.batch_size * len(dev.users_of_device(job, device))
    train_blocks = dev.device_split(job, device, "train")
    router_split = "valid" if job.method.router_data == "valid" else "train"
    metrics = trainer.train_iterations(
        job.recipe.federation.local_iterations,
        dev.batch_sampler(train_blocks, batch, seed, "train"),
        dev.batch_sampler(dev.device_split(job, device, router_split), batch, seed, f"router-{router_split}"),
    )
    return metrics, int(train_blocks.shape[0])


def _train_classifier(job: Job, device: int, trainer: DeviceTrainer, seed: int) -> tuple[dict, int]:
    examples = dev.federated_task(job).train[device]
    sampler, per_epoch = dev.epoch_sampler(examples, job.recipe.task.batch_size, seed)
    epochs = job.recipe.federation.local_epochs
    iterations = epochs * per_epoch if epochs else job.recipe.federation.local_iterations
    # The trainer's iteration count runs on across rounds, and so do the epochs.
    metrics = trainer.train_iterations(iterations, sampler, sampler)
    return metrics, len(examples)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    job = job_from_context(context)
    device = _device_index(context)
    model = dev.restore_trainer(job, device, msg.content.array_records.get("arrays"), context.state).model
    metrics = evaluate_device(job, device, model)
    metrics["device"] = device
    if msg.content["config"].get("final", False) and job.method.trains:
        dev.save_checkpoint(job, device, model)
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
