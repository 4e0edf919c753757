"""The Flower ClientApp: one device's side of every method.

``train``: rebuild the device's model from the server's shared tensors and the
private state in ``context.state``, run the method's local procedure, keep the
private part, and reply with the shared part only. ``evaluate``: test
perplexity in distribution (the user's own test split) and out of
distribution (the union of all users' test splits).
"""

from __future__ import annotations

import zlib

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import job_from_context
from ondevice_moe.training import block_nll, perplexity_of

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
    # The centralized upper bound sees every user's batch at once (CoMiGS: 64 × 4).
    batch = job.recipe.data.batch_size * len(dev.users_of_device(job, device))
    train_blocks = dev.device_split(job, device, "train")
    router_split = "valid" if job.method.router_data == "valid" else "train"
    metrics = trainer.train_iterations(
        job.recipe.federation.local_iterations,
        dev.batch_sampler(train_blocks, batch, seed, "train"),
        dev.batch_sampler(dev.device_split(job, device, router_split), batch, seed, f"router-{router_split}"),
    )
    dev.save_private_state(trainer, context.state)
    metrics.update({"device": device, "num-examples": int(train_blocks.shape[0])})
    content = RecordDict({"arrays": ArrayRecord(dev.shared_state(trainer)), "metrics": MetricRecord(metrics)})
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    job = job_from_context(context)
    device = _device_index(context)
    model = dev.restore_trainer(job, device, msg.content.array_records.get("arrays"), context.state).model
    batch = job.recipe.data.eval_batch_size
    per_user = [dev.eval_blocks(job, u) for u in range(len(job.recipe.data.users))]
    union_nll = block_nll(model, torch.cat(per_user), batch)
    context_length = per_user[0].shape[1]
    offsets = torch.tensor([0, *(b.shape[0] for b in per_user)]).cumsum(0).tolist()
    metrics: dict[str, float] = {"device": device, "num-examples": int(union_nll.numel())}
    for user in dev.users_of_device(job, device):
        own = union_nll[offsets[user] : offsets[user + 1]]
        metrics[f"user_{user}/test_ppl_in"] = perplexity_of(own, context_length)
        metrics[f"user_{user}/test_ppl_out"] = perplexity_of(union_nll, context_length)
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
