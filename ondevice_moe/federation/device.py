"""What lives on a device: the base model (loaded once per process), the
user's data, and the trainer rebuilt each round from shared tensors sent by
the server plus private state kept by :mod:`~ondevice_moe.federation.device_state`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from flwr.app import RecordDict
from torch import nn

from ondevice_moe.data.blocks import BlockExamples
from ondevice_moe.data.classification import ClientExamples, FederatedTask, build_federated_task
from ondevice_moe.data.small import SmallFederatedTask, TensorExamples, build_small_task
from ondevice_moe.data.sources import device_source_kind
from ondevice_moe.data.splits import SourceSpec, UserData, build_user_data
from ondevice_moe.errors import UserError
from ondevice_moe.federation import device_state
from ondevice_moe.federation.faults import flips_labels
from ondevice_moe.federation.job import Job
from ondevice_moe.federation.node import FIX
from ondevice_moe.layout import attach_layout
from ondevice_moe.methods import Method, Role
from ondevice_moe.models import LoadedModel, load_base_model, load_base_structure
from ondevice_moe.models.checkpointing import enable_activation_checkpointing
from ondevice_moe.models.heads import head_paths
from ondevice_moe.names import folder_name
from ondevice_moe.recipe import SourceSection
from ondevice_moe.routing.lifecycle import routed_upload
from ondevice_moe.safe_files import save_tensors, write_text
from ondevice_moe.sampling import batch_sampler, epoch_sampler
from ondevice_moe.training import DeviceTrainer, trainable_state


@lru_cache(maxsize=2)
def base_model(name: str, dtype: str, quantization: str, num_labels: int | None, seed: int, device: str,
               regression: bool | None = None, input_shape: tuple[int, ...] | None = None,
               bias: bool = True) -> LoadedModel:
    """The frozen base model, loaded once per process."""
    return load_base_model(name, dtype, quantization, num_labels, seed, device, regression=regression,
                           input_shape=input_shape, model_options=small_model_options(bias))


@lru_cache(maxsize=2)
def base_structure(name: str, dtype: str, num_labels: int | None, seed: int, regression: bool | None = None,
                   input_shape: tuple[int, ...] | None = None, bias: bool = True) -> nn.Module:
    """The base model without its weights (:func:`~ondevice_moe.models.registry.load_base_structure`),
    built once per process."""
    return load_base_structure(name, dtype, num_labels, seed, regression=regression, input_shape=input_shape,
                               model_options=small_model_options(bias))


def small_model_options(bias: bool) -> dict[str, object] | None:
    """The small models' options a recipe sets (``model.bias``)."""
    return None if bias else {"bias": False}


def job_base_model(job: Job) -> LoadedModel:
    model = job.recipe.model
    num_labels, seed, regression, input_shape, bias = _base_options(job)
    return base_model(model.name, model.dtype, model.quantization, num_labels, seed, model.device,
                      regression, input_shape, bias)


def job_base_structure(job: Job) -> nn.Module:
    """The job's base model as names, shapes and dtypes only: what the server needs of it."""
    model = job.recipe.model
    return base_structure(model.name, model.dtype, *_base_options(job))


def _base_options(job: Job) -> tuple[int | None, int, bool | None, tuple[int, ...] | None, bool]:
    """The task's side of the base model: labels, seed, regression, input shape and ``model.bias``."""
    if job.recipe.task is None:
        return None, job.recipe.seed, None, None, True
    spec = job.recipe.task.spec()
    return spec.num_labels, job.recipe.seed, spec.is_regression, spec.input_shape, job.recipe.model.bias


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
    one = {name: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
           for name, tensor in trainable_state(model).items() if name in travelling(job.method, model)}
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


def run_local_procedure(job: Job, device: int, trainer: DeviceTrainer, seed: int,
                        server_round: int = 0) -> tuple[dict[str, float], int]:
    """Run the method's local procedure for one round; returns train metrics and the example count."""
    return job.method.procedure.train_round(JobDevice(job, device, seed=seed, server_round=server_round), trainer)


def train_steps(job: Job, device: int, trainer: DeviceTrainer, seed: int,
                server_round: int = 0) -> tuple[dict[str, float], int]:
    """Plain local training: a language model's ``local_iterations`` expert steps on random blocks of
    the training split, with router phases on the router split; a classifier's steps over seeded
    epochs of its examples (the trainer's iteration count runs on across rounds, and so do the epochs)."""
    if job.recipe.is_language_modelling:
        batch = _language_model_batch(job, device)
        train_blocks = device_examples(job, device, "train")
        router_split = job.method.procedure.router_data
        metrics = trainer.train_iterations(
            job.recipe.federation.local_iterations,
            batch_sampler(train_blocks, batch, seed, "train"),
            batch_sampler(router_blocks(job, device), batch, seed, f"router-{router_split}"),
        )
        return metrics, len(train_blocks)
    examples = federated_task(job).train[device]
    if flips_labels(job.recipe.federation.faults, device, server_round):  # a Byzantine device (recipe faults)
        examples = replace(examples, labels=job.recipe.task.spec().num_labels - 1 - examples.labels)
    sampler, per_epoch = epoch_sampler(examples, job.recipe.task.batch_size, seed)
    metrics = trainer.train_iterations(_local_steps(job, per_epoch), sampler, sampler)
    return metrics, len(examples)


def _language_model_batch(job: Job, device: int) -> int:
    """A language model's training batch: the centralized upper bound sees every user's batch at
    once (CoMiGS: 64 × 4)."""
    return job.recipe.data.batch_size * len(users_of_device(job, device))


@dataclass
class JobDevice:
    """Device ``index`` of a job, as a method's procedure sees it
    (:class:`~ondevice_moe.methods.procedure.OnDevice`): its seed (default :func:`device_seed`),
    what it keeps between rounds (``state``), its own data and the recipe's settings. Scoring a
    model belongs to a test (:class:`~ondevice_moe.federation.evaluation.TestedDevice`)."""

    job: Job
    index: int
    state: MutableMapping[str, Any] = field(default_factory=RecordDict)
    seed: int = -1
    server_round: int = 0
    _travelling: set[str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.seed < 0:
            self.seed = device_seed(self.job, self.index)

    @property
    def method(self) -> Method:
        return self.job.method

    @property
    def recipe_seed(self) -> int:
        return self.job.recipe.seed

    @property
    def is_language_modelling(self) -> bool:
        return self.job.recipe.is_language_modelling

    @property
    def batch_size(self) -> int:
        if self.is_language_modelling:
            return _language_model_batch(self.job, self.index)
        return self.job.recipe.task.batch_size

    @property
    def eval_batch_size(self) -> int:
        recipe = self.job.recipe
        return recipe.data.eval_batch_size if self.is_language_modelling else recipe.task.eval_batch_size

    def local_steps(self, per_epoch: int) -> int:
        return _local_steps(self.job, per_epoch)

    def blocks(self, split: str) -> torch.Tensor:
        return device_split(self.job, self.index, split)

    def training_examples(self) -> Any:
        if self.is_language_modelling:
            return device_examples(self.job, self.index, "train")
        return federated_task(self.job).train[self.index]

    def test_examples(self) -> Any:
        return scored_examples(self.job, self.index)

    def build_model(self, seed: int | None = None) -> nn.Module:
        return build_model(self.job, self.index, seed=seed)

    def base_model_from(self, seed: int) -> nn.Module:
        model, spec = self.job.recipe.model, self.job.recipe.task.spec()
        with torch.random.fork_rng(devices=[]):
            loaded = load_base_model(model.name, model.dtype, model.quantization, spec.num_labels, seed, model.device,
                                     regression=spec.is_regression, input_shape=spec.input_shape,
                                     model_options=small_model_options(model.bias))
        return loaded.model

    def trainer(self, model: nn.Module) -> DeviceTrainer:
        return DeviceTrainer(model, self.job.method, self.job.training)

    def travels(self, name: str) -> bool:
        if self._travelling is None:  # the model's structure says it: no weights needed
            structure = build_model(self.job, self.index, base=job_base_structure(self.job))
            self._travelling = travelling(self.method, structure)
        return name in self._travelling

    def shared_state(self, trainer: DeviceTrainer) -> dict[str, torch.Tensor]:
        return shared_state(trainer)

    def train_steps(self, trainer: DeviceTrainer) -> tuple[dict[str, float], int]:
        return train_steps(self.job, self.index, trainer, self.seed, self.server_round)

    def cluster_tests(self) -> list[Any] | None:
        raise NotImplementedError("a model is scored in a test (evaluation.TestedDevice)")

    def test_on(self, model: nn.Module, examples: Any) -> float:
        raise NotImplementedError("a model is scored in a test (evaluation.TestedDevice)")

    def score(self, model: nn.Module) -> dict[str, float]:
        raise NotImplementedError("a model is scored in a test (evaluation.TestedDevice)")


def device_seed(job: Job, device: int) -> int:
    """The seed of a device's training draws (batches, Flow's halves)."""
    return job.recipe.seed * 1000 + device


def _local_steps(job: Job, per_epoch: int) -> int:
    """A round's steps: ``local_epochs`` epochs of a classifier's examples, else ``local_iterations``."""
    epochs = job.recipe.federation.local_epochs
    if epochs and not job.recipe.is_language_modelling:
        return epochs * per_epoch
    return job.recipe.federation.local_iterations
