"""A device's round: its local procedure and training steps, and :class:`JobDevice`, which binds a job to
one device index for the client app."""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from flwr.app import RecordDict
from torch import nn

from ondevice_moe.federation.device.base import job_base_structure, small_model_options
from ondevice_moe.federation.device.data import (
    device_examples,
    device_split,
    federated_task,
    router_blocks,
    scored_examples,
    users_of_device,
)
from ondevice_moe.federation.device.model import build_model
from ondevice_moe.federation.device.upload import shared_state, travelling
from ondevice_moe.federation.faults import flips_labels
from ondevice_moe.federation.job import Job
from ondevice_moe.methods import Method
from ondevice_moe.models import load_base_model
from ondevice_moe.sampling import batch_sampler, epoch_sampler
from ondevice_moe.training import DeviceTrainer


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
