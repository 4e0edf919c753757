"""A device's data: its users' blocks or examples, the task dealt from the recipe, read once per process."""

from __future__ import annotations

from pathlib import Path

import torch

from ondevice_moe.data.blocks import BlockExamples
from ondevice_moe.data.classification import ClientExamples, FederatedTask, build_federated_task
from ondevice_moe.data.small import SmallFederatedTask, TensorExamples, build_small_task
from ondevice_moe.data.sources import device_source_kind
from ondevice_moe.data.splits import SourceSpec, UserData, build_user_data
from ondevice_moe.errors import UserError
from ondevice_moe.federation.device.base import job_base_model
from ondevice_moe.federation.job import Job
from ondevice_moe.federation.node import FIX
from ondevice_moe.recipe import SourceSection

_TASKS: dict[str, FederatedTask | SmallFederatedTask] = {}


def federated_task(job: Job) -> FederatedTask | SmallFederatedTask:
    """The task dealt to the clients, built once per process: texts (tokenized) or small tensors."""
    task = job.recipe.task
    key = task.model_dump_json() + job.recipe.model.name + str(job.recipe.split_seed)
    if key not in _TASKS:
        spec = task.spec()
        if spec.is_text:
            _TASKS[key] = build_federated_task(
                spec, task.clients, task.dirichlet_alpha, job_base_model(job).tokenizer, task.max_length,
                job.recipe.split_seed, task.max_train_examples, task.max_test_examples, task.clusters,
                task.valid_examples)
        else:
            _TASKS[key] = build_small_task(task.name, task.clients, job.recipe.split_seed, task.clusters,
                                           task.dirichlet_alpha, task.data_fraction, task.valid_examples)
    return _TASKS[key]


_SIZES: dict[str, list[int]] = {}


def training_sizes(job: Job) -> list[int] | None:
    """How many training examples each client holds, where the server can know it without asking the
    clients: a task dealt from the recipe (a small task, or a text task's label partition, read but not
    tokenized). ``None`` for the users' own text, which only their devices hold."""
    task = job.recipe.task
    if task is None:
        return None
    key = task.model_dump_json() + str(job.recipe.split_seed)
    if key not in _SIZES:
        spec = task.spec()
        if spec.is_text:
            from ondevice_moe.data.classification import deal_task

            train = deal_task(spec, task.clients, task.dirichlet_alpha, job.recipe.split_seed,
                              task.max_train_examples, task.max_test_examples, task.valid_examples)[0]
            _SIZES[key] = [len(examples.labels) for examples in train]
        else:
            _SIZES[key] = [len(examples) for examples in federated_task(job).train]
    return _SIZES[key]


def scored_examples(job: Job, device: int) -> ClientExamples | TensorExamples:
    """The examples a client's task metric is scored on: its ``task.eval_split`` (the test split, or
    the validation split held out of training for choosing a learning rate)."""
    task = federated_task(job)
    if job.recipe.task.eval_split == "valid":
        return task.valid[device]  # the recipe holds task.valid_examples, so the task was built with them
    return task.test[device]


_DATA: dict[tuple[str, int], UserData] = {}  # keyed by the data section, model, seed, data-path and user


def user_data(job: Job, user: int) -> UserData:
    """User (device) ``user``'s blocks of its domain (``data.clients``: several devices per domain),
    built once per process."""
    key = (job.recipe.data.model_dump_json() + job.recipe.model.name + str(job.recipe.split_seed)
           + str(job.node and job.node.data_path), user)
    if key not in _DATA:
        data = job.recipe.data
        section = data.domain(user)
        sources = [_source_on_this_machine(job, user, s) for s in section.sources]
        _DATA[key] = build_user_data(data.device_names[user], sources, job_base_model(job).tokenizer,
                                     data.budgets(user), data.context_length, job.recipe.split_seed + 7919 * user)
    return _DATA[key]


def _source_on_this_machine(job: Job, user: int, source: SourceSection) -> SourceSpec:
    """How this machine reads one source of user ``user``. On a device (``flwr run``) only its own
    user's, and ``source: device`` is the device's own ``data-path``; no device reads another's data."""
    if not job.on_device:
        return SourceSpec(source.source, source.options(), source.weight)
    node = job.node
    if user != node.partition_id:
        raise UserError(f"device {node.partition_id} was asked for user {user}'s data, which only that user's "
                        "device holds", "this recipe or method needs every user's data on one machine: run it in "
                        "the local simulation (ondevice-moe finetune without --federation)")
    if source.source != "device":
        if source.path is not None:  # the server checks this before it sends anything; a device checks again
            raise UserError(f"the server's recipe asks this device to read `{source.source}` at a path of its "
                            "choosing; a device reads only its own --node-config data-path",
                            "give the user `source: device` in the recipe")
        return SourceSpec(source.source, source.options(), source.weight)
    if node.data_path is None:
        raise UserError(f"user '{job.recipe.user_names[user]}' has `source: device`, but this device's "
                        "--node-config has no data-path", FIX)
    confine(node.data_path)
    options = {**source.options(), "path": str(node.data_path)}
    return SourceSpec(device_source_kind(node.data_path), options, source.weight)


def confine(data_path: Path) -> None:
    """A device reads nothing outside its data-path: a link under it that leads out of it is refused."""
    root = data_path.expanduser().resolve()
    if not data_path.is_dir():
        return
    for path in data_path.rglob("*"):
        if path.is_symlink() and not path.resolve().is_relative_to(root):
            raise UserError(f"this device's data-path holds {path.relative_to(data_path)}, a link that leads out of "
                            "the data-path", "copy the data into the data-path, or remove the link")


_SOURCES: dict[str, list[tuple[str, BlockExamples]]] = {}


def source_test_blocks(job: Job) -> list[tuple[str, torch.Tensor]]:
    """The token ids of :func:`source_test_examples`."""
    return [(name, examples.blocks) for name, examples in source_test_examples(job)]


def source_test_examples(job: Job) -> list[tuple[str, BlockExamples]]:
    """Each distinct source of the users' text alone, with test blocks of its own (``data.test_tokens``,
    cut to ``data.max_eval_blocks``): where FedSoft's centres are scored one source at a time
    (Tables 1, 3) when the users hold mixtures. Drawn with seeds of their own, so a document
    may also sit in a user's training split, as documents may between users of one source."""
    data = job.recipe.data
    key = data.model_dump_json() + job.recipe.model.name + str(job.recipe.split_seed)
    if key not in _SOURCES:
        distinct = {}
        for user in data.users:
            for source in user.sources:
                distinct.setdefault(source.model_dump_json(exclude={"weight"}), source)
        budgets = {"train": data.context_length, "valid": data.context_length, "test": data.test_tokens}
        tests = []
        for index, source in enumerate(distinct.values()):
            built = build_user_data(source.source, [SourceSpec(source.source, source.options(), 1.0)],
                                    job_base_model(job).tokenizer, budgets, data.context_length,
                                    job.recipe.split_seed + 104729 * (index + 1))
            test = built.examples("test")
            tests.append((source.source, test if data.max_eval_blocks is None else test[: data.max_eval_blocks]))
        _SOURCES[key] = tests
    return _SOURCES[key]


def users_of_device(job: Job, device: int) -> list[int]:
    """The users whose data a device holds: all of them for the centralized upper bound."""
    return list(range(job.recipe.data.devices)) if job.method.centralized else [device]


def domain_users(job: Job) -> range:
    """One user per domain: the first devices, ``k < D``, hold ``users[k]`` (every user without ``data.clients``)."""
    return range(len(job.recipe.data.users))


def device_examples(job: Job, device: int, split: str) -> BlockExamples:
    """The blocks of ``split`` of the users a device holds, with their labels."""
    return BlockExamples.concatenate([user_data(job, u).examples(split) for u in users_of_device(job, device)])


def device_split(job: Job, device: int, split: str) -> torch.Tensor:
    """The token ids of :func:`device_examples`."""
    return device_examples(job, device, split).blocks


def router_blocks(job: Job, device: int) -> BlockExamples:
    """The blocks a device's routers learn on (CoMiGS eq. 4).

    The validation split "reflects the target distribution" (§2.1): the
    device's own (``data.router_validation: own``), or, when the target is the
    union of all users' distributions (the out-of-distribution task, §3.1.2,
    Fig. 4), every user's validation split (``union``; one device per domain
    under ``data.clients``). The ``-tr`` ablation uses the training split.
    """
    split = job.method.procedure.router_data
    if split == "valid" and job.recipe.data.router_validation == "union":
        return BlockExamples.concatenate([user_data(job, user).examples("valid") for user in domain_users(job)])
    return device_examples(job, device, split)


def eval_examples(job: Job, user: int) -> BlockExamples:
    """The blocks a user's perplexities are scored on: its ``data.eval_split`` (the test split,
    or the validation split for choosing a learning rate), cut to ``data.max_eval_blocks``."""
    examples = user_data(job, user).examples(job.recipe.data.eval_split)
    cap = job.recipe.data.max_eval_blocks
    return examples if cap is None else examples[:cap]


def eval_blocks(job: Job, user: int) -> torch.Tensor:
    """The token ids of :func:`eval_examples`."""
    return eval_examples(job, user).blocks
