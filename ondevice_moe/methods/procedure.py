"""A method's device side: :class:`Procedure`, the hooks a device runs each round, and
:class:`OnDevice`, what a procedure may ask of the device it runs on.

The shared trainer (:class:`~ondevice_moe.training.DeviceTrainer`) and the Flower client
(:mod:`ondevice_moe.federation.client_app`) know only these hooks; every method's own device
work — FedSoft's importances, FedEM's E-step, Flow's three phases, PCL's peer mixing, FDLoRA's
turns, HetLoRA's pruning, FLoRAL's preconditioning — is a subclass in the method's folder that
overrides the hooks where it differs, the way Flower's ``FedProx(FedAvg)`` overrides only what
FedProx changes. The base class is plain local training: the round's expert steps on the
training split, with router phases (``routers``) where the layout learns its routers.

A round on a device calls, in order::

    begin_round → train_round (trainer steps: idle_parameters, loss_terms, adjust_gradients,
    after_step) → upload

and a test calls ``prepare_test`` then ``evaluate``.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from ondevice_moe.training import DeviceTrainer

Tensors = dict[str, torch.Tensor]


class OnDevice(Protocol):
    """What a procedure may ask of the device it runs on: which device, its seed, its data
    (never another device's) and the recipe's settings that shape a round. The federation's
    device runtime implements it (:class:`~ondevice_moe.federation.device.JobDevice`)."""

    index: int
    seed: int
    """The seed of the device's training draws (batches, splits)."""
    recipe_seed: int
    method: Any
    """The :class:`~ondevice_moe.methods.base.Method` the device runs."""
    state: MutableMapping[str, Any]
    """What the device keeps between rounds beside its tensors (Flower's ``context.state``)."""

    @property
    def is_language_modelling(self) -> bool: ...

    @property
    def batch_size(self) -> int:
        """A training batch: a language model's blocks per step, or a classifier's examples."""
        ...

    @property
    def eval_batch_size(self) -> int: ...

    def local_steps(self, per_epoch: int) -> int:
        """A round's steps, given how many steps make one epoch of the device's examples."""
        ...

    def blocks(self, split: str) -> torch.Tensor:
        """A language model's blocks of ``split`` (``train``, ``valid``, ``test``) of the device's users."""
        ...

    def training_examples(self) -> Any:
        """The device's training examples (``len`` and ``batch(rows)``): blocks or a task's examples."""
        ...

    def test_examples(self) -> Any:
        """A classifier's held-out examples of this device: those it is scored on (``task.eval_split``)."""
        ...

    def cluster_tests(self) -> list[Any] | None:
        """Each source (cluster) of the task alone, its held-out examples (blocks of text, or a
        task's examples) — public held-out sets, not a device's data; ``None`` where this device
        may not read them all (a real device when users bring their own text)."""
        ...

    def test_on(self, model: nn.Module, examples: Any) -> float:
        """``model`` on held-out ``examples``: a language model's perplexity on blocks, a
        classifier's task metric as reported."""
        ...

    def build_model(self, seed: int | None = None) -> nn.Module:
        """This device's model as first built (experts from ``seed``, default the recipe's)."""
        ...

    def base_model_from(self, seed: int) -> nn.Module:
        """A whole small model freshly initialised from ``seed`` (no shared base)."""
        ...

    def trainer(self, model: nn.Module) -> DeviceTrainer:
        """A fresh trainer of ``model`` with the recipe's training settings."""
        ...

    def travels(self, name: str) -> bool:
        """Whether a trained tensor may leave the device."""
        ...

    def shared_state(self, trainer: DeviceTrainer) -> Tensors:
        """Copies of the trainer's tensors that leave the device this round."""
        ...

    def score(self, model: nn.Module) -> dict[str, float]:
        """The plain test of ``model``: ``user_<i>/<value>`` entries and ``num-examples``."""
        ...

    def train_steps(self, trainer: DeviceTrainer) -> tuple[dict[str, float], int]:
        """The round's plain local training: expert steps (and router phases) on the training
        split; the train metrics and the examples trained on."""
        ...


@dataclass(frozen=True)
class Procedure:
    """A device's local work each round: plain local training, which a method subclasses.

    ``experts`` phase: the experts (and task head) train on the ``train`` split every
    iteration. ``routers``: ``none`` (no learned router), ``joint`` (routers train with the
    experts on the training loss: Hermes, Local-MoE) or ``bilevel`` (CoMiGS Alg. 1: a router
    phase of ``router_steps`` steps on the ``router_data`` split every τ iterations, experts
    held fixed). ``full_finetune`` trains every weight of the base (FedFT). ``joint_router_lr``:
    joint routers train in their own parameter group at this rate (FLoRAL's code trains θ at 0.1
    beside weights at 0.03 on the synthetic MLP); ``None``: at the experts' rate.
    """

    routers: Literal["none", "joint", "bilevel"] = "none"
    router_data: Literal["valid", "train"] = "valid"
    full_finetune: bool = False
    joint_router_lr: float | None = None

    def recipe_problems(self, method_name: str, *, hugging_face: bool, language_modelling: bool,
                        private: bool) -> list[str]:
        """What a recipe asks of this procedure that it cannot do, each with its fix (checked when
        the recipe is validated): ``hugging_face`` base model, ``language_modelling`` task,
        ``private`` (differential privacy on the updates)."""
        return []

    # -- a round ------------------------------------------------------------
    @property
    def loads_received(self) -> bool:
        """Whether the server's tensors are loaded into the model before the round (else they are
        only read, by :meth:`begin_round`, and the device trains on from its own model)."""
        return True

    def begin_round(self, device: OnDevice, trainer: DeviceTrainer, received: Tensors | None,
                    server_round: int) -> dict[str, float]:
        """Set up the round once the model holds the device's state; returns what the device chose."""
        return {}

    def train_round(self, device: OnDevice, trainer: DeviceTrainer) -> tuple[dict[str, float], int]:
        """The round's local training; the train metrics and the weight of the upload."""
        return device.train_steps(trainer)

    def upload(self, trainer: DeviceTrainer, tensors: Tensors, records: dict[str, dict]
               ) -> tuple[Tensors, dict[str, dict]]:
        """What the device sends: the model's shared tensors and the records the server weighs them by."""
        return tensors, records

    def upload_reference(self, tensors: Tensors) -> Tensors:
        """Every tensor the device may upload, given the model's (what the server checks against)."""
        return tensors

    @property
    def server_keeps_models(self) -> bool:
        """Whether the server keeps models of its own at the end, which no device holds."""
        return False

    def server_models(self, tensors: Tensors) -> dict[int, Tensors]:
        """The models the server kept, by index, from its saved ``tensors``."""
        return {}

    def fit_received(self, model: nn.Module, tensors: Tensors) -> Tensors:
        """The received tensors made to fit the device's model."""
        return tensors

    # -- a step (called by the trainer) --------------------------------------
    def idle_parameters(self, trainer: DeviceTrainer) -> set[int]:
        """Ids of parameters an expert step leaves untouched."""
        return set()

    def loss_terms(self, trainer: DeviceTrainer, *, train_experts: bool, train_router: bool
                   ) -> torch.Tensor | None:
        """Terms the method adds to a step's loss (after the routers' balance loss)."""
        return None

    def adjust_gradients(self, trainer: DeviceTrainer) -> None:
        """Change the gradients between backward and the optimiser step."""

    def after_step(self, trainer: DeviceTrainer) -> None:
        """Act on the parameters right after the optimiser step."""

    # -- a test ---------------------------------------------------------------
    def prepare_test(self, device: OnDevice, model: nn.Module, received: Tensors | None) -> dict[str, float]:
        """Make ``model`` (holding the device's state, and the received tensors where
        :attr:`loads_received`) the one the device is tested with; returns extra scores."""
        return {}

    def evaluate(self, device: OnDevice, model: nn.Module) -> dict[str, float]:
        """The device's test of ``model`` (also ``ondevice-moe eval`` on a checkpoint)."""
        return device.score(model)
