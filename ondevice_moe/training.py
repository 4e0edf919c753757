"""A device's local procedure: expert steps on the training split, router steps
on the validation split (CoMiGS Alg. 1), and a classifier's predictions.

These are plain functions over a model with experts attached; the Flower
client calls them, and unit tests call them directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, Protocol

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LinearLR, LRScheduler, SequentialLR

from ondevice_moe.example_loss import EXAMPLE_WEIGHTS, example_loss
from ondevice_moe.layout import routing_sites, total_balance_loss
from ondevice_moe.models.devices import model_device
from ondevice_moe.routing.lifecycle import forward_pass, round_aware


@dataclass(frozen=True)
class TrainingConfig:
    """Defaults follow the text of CoMiGS App. B.1.2: lr 2e-3 (one-cycle cosine)
    for experts, 2e-3 constant for routers, τ = 30, s = 10, balance weight 0.01,
    with AdamW's own β and no weight decay. The authors' code (epfml/CoMiGS,
    ``collab_utils/clients.py``) differs: AdamW β = (0.9, 0.95), weight decay
    1e-2 on experts and routers, and ``lr_schedule="cosine"`` (cosine annealing
    to lr/10, no warm-up); the bundled CoMiGS recipes use the code's settings.
    Hermes uses Adam at 2e-4 with weight decay 1e-4 and a constant rate (§5.1).
    FLoRAL's code trains with plain SGD (``optimizer="sgd"``: no momentum) and no
    clipping (``grad_clip=None``); Flow's code (``trainers/client_flow.py``) with SGD at
    ``momentum=0.9``, fresh each round. ``compile`` puts the model under ``torch.compile``
    (:meth:`torch.nn.Module.compile`, in place): the first training step and the first evaluation
    in a process compile (tens of seconds on a CPU), and a later round's model of the same shape
    reuses what they compiled."""

    lr: float = 2e-3
    router_lr: float = 2e-3
    router_period: int = 30
    router_steps: int = 10
    balance_weight: float = 0.01
    batch_size: int = 64
    total_iterations: int = 200
    warmup_fraction: float = 0.05
    grad_clip: float | None = 1.0
    weight_decay: float = 0.0
    router_weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_schedule: Literal["one-cycle-cosine", "cosine", "constant"] = "one-cycle-cosine"
    optimizer: Literal["adamw", "sgd"] = "adamw"
    momentum: float = 0.0
    compile: bool = False


Batch = dict[str, torch.Tensor]
BatchSource = Callable[[int], Batch]


class StepHooks(Protocol):
    """What the trainer asks of a method's procedure (:class:`~ondevice_moe.methods.procedure.Procedure`)."""

    routers: str
    joint_router_lr: float | None

    def idle_parameters(self, trainer: DeviceTrainer) -> set[int]: ...

    def loss_terms(self, trainer: DeviceTrainer, *, train_experts: bool, train_router: bool
                   ) -> torch.Tensor | None: ...

    def adjust_gradients(self, trainer: DeviceTrainer) -> None: ...

    def after_step(self, trainer: DeviceTrainer) -> None: ...


class TrainedMethod(Protocol):
    """What the trainer asks of a method (:class:`~ondevice_moe.methods.base.Method`)."""

    procedure: StepHooks

    def is_trainable(self, name: str) -> bool: ...


@dataclass(frozen=True)
class StepFigures:
    """What a tracker plots of one step besides its loss: the first parameter group's learning rate as the
    step used it, and the gradients' total L2 norm before clipping."""

    lr: float
    grad_norm: float


@dataclass
class DeviceTrainer:
    """The trainable state of one device: its model, optimisers and iteration count.

    A parameter is trainable when the model was built with ``requires_grad``
    on it (experts, routers, task heads) and the method does not freeze it. Each step
    calls the method's procedure (:class:`~ondevice_moe.methods.procedure.Procedure`) for
    the parameters it leaves idle, the terms it adds to the loss, its change to the
    gradients and its action after the step; ``round_state`` is where a procedure keeps
    what it set up for the round (a trainer lives for one round).
    A batch that carries ``example_weights`` (:class:`~ondevice_moe.example_loss.WeightedExamples`)
    is trained on the batch mean of weight × per-example loss in place of the model's own loss.
    """

    model: nn.Module
    method: TrainedMethod
    config: TrainingConfig
    iteration: int = 0
    expert_optimizer: torch.optim.Optimizer | None = field(default=None, init=False)
    router_optimizer: torch.optim.Optimizer | None = field(default=None, init=False)
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = field(default=None, init=False)
    round_state: dict[str, Any] = field(default_factory=dict, init=False)
    last_step: StepFigures | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.config.compile:
            self.model.compile()
        self.trainable = [(n, p) for n, p in self.model.named_parameters()
                          if p.requires_grad and self.method.is_trainable(n)]
        self.round_aware = round_aware(self.model)  # routers with state outside the graph (routing/lifecycle.py)
        groups = [{"params": self.expert_parameters()}]
        if self.method.procedure.routers == "joint":
            self._add_joint_routers(groups)
        groups = [group for group in groups if group["params"]]
        if groups:
            self.expert_optimizer = self._optimizer(groups, self.config.lr, self.config.weight_decay)
            self.scheduler = self._schedule(self.expert_optimizer)
        if self.method.procedure.routers == "bilevel" and self.router_parameters():
            self.router_optimizer = self._optimizer(self.router_parameters(), self.config.router_lr,
                                                    self.config.router_weight_decay)

    def _add_joint_routers(self, groups: list[dict]) -> None:
        """Routers trained with the experts join the experts' group, or get their own rate."""
        rate = self.method.procedure.joint_router_lr
        if rate is None:
            groups[0]["params"] += self.router_parameters()
        else:
            groups.append({"params": self.router_parameters(), "lr": rate,
                           "weight_decay": self.config.router_weight_decay})

    def _optimizer(self, params: list, lr: float, weight_decay: float) -> torch.optim.Optimizer:
        if self.config.optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=self.config.momentum, weight_decay=weight_decay)
        return torch.optim.AdamW(params, lr=lr, betas=self.config.betas, weight_decay=weight_decay)

    def _schedule(self, optimizer: torch.optim.Optimizer) -> LRScheduler | None:
        """The experts' learning-rate schedule, stepped once per expert step; none for a constant rate."""
        total = max(self.config.total_iterations, 1)
        if self.config.lr_schedule == "one-cycle-cosine":
            return one_cycle_cosine(optimizer, total, warmup=max(1, round(self.config.warmup_fraction * total)))
        if self.config.lr_schedule == "cosine":
            return cosine_to_tenth(optimizer, total)
        return None

    # -- parameter groups -------------------------------------------------
    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.trainable if not _is_router(name)]

    def router_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.trainable if _is_router(name)]

    # -- steps ------------------------------------------------------------
    def train_iterations(self, iterations: int, train_batches: BatchSource, router_batches: BatchSource
                         ) -> dict[str, float | list[float]]:
        """Run ``iterations`` expert steps, with router phases every τ iterations.

        ``train_batches(i)`` and ``router_batches(i)`` return the batch for global
        iteration/step ``i``; the router batches come from the validation split
        (or fresh training batches in the ``-tr`` ablation). Returns the mean ``train_loss``,
        each step's loss (``step_losses``: steps ``iteration - len + 1`` to ``iteration``), learning rate
        (``step_lrs``) and gradient norm before clipping (``step_grad_norms``), the
        router phases' mean ``router_loss``, the round figures of the model's round-aware modules
        (:meth:`~ondevice_moe.routing.lifecycle.RoundAware.round_metrics`) and each expert's mean score per layer.
        """
        losses, router_losses, figures = [], [], []
        device = model_device(self.model)
        score_sums = [torch.zeros(len(m.expert_names), device=device) for m in routing_sites(self.model)]
        for _ in range(iterations):
            self.iteration += 1
            losses.append(self.expert_step(train_batches(self.iteration)))
            figures.append(self.last_step)
            for sums, site in zip(score_sums, routing_sites(self.model), strict=True):
                sums += site.last_scores
            if self.router_optimizer is not None and self.iteration % self.config.router_period == 0:
                for step in range(self.config.router_steps):
                    router_index = (self.iteration // self.config.router_period) * self.config.router_steps + step
                    router_losses.append(self.router_step(router_batches(router_index)))
        metrics: dict[str, float | list[float]] = {
            "train_loss": sum(losses) / max(len(losses), 1), "step_losses": losses, "iteration": float(self.iteration)}
        if figures and all(figure is not None for figure in figures):
            metrics["step_lrs"] = [figure.lr for figure in figures]
            metrics["step_grad_norms"] = [figure.grad_norm for figure in figures]
        if router_losses:
            metrics["router_loss"] = sum(router_losses) / len(router_losses)
        for module in self.round_aware:
            metrics.update(module.round_metrics())
        for layer, (sums, site) in enumerate(zip(score_sums, routing_sites(self.model), strict=True)):
            for name, total in zip(site.expert_names, sums.tolist(), strict=True):
                metrics[f"layer_{layer}/expert_{name}_score"] = total / max(iterations, 1)
        return metrics

    def expert_step(self, batch: Batch, idle: frozenset[int] = frozenset()) -> float:
        """One step on the experts (CoMiGS eq. 3); routers are held fixed unless trained jointly.
        The parameters whose ids are in ``idle`` (a phase's, and the procedure's for this step)
        stay as they are."""
        idle = set(idle) | self.method.procedure.idle_parameters(self)
        return self._step(batch, self.expert_optimizer, train_router=self.method.procedure.routers == "joint",
                          train_experts=True, scheduler=self.scheduler, idle=idle)

    def router_step(self, batch: Batch) -> float:
        """One step on the routers (CoMiGS eq. 4); experts are held fixed."""
        return self._step(batch, self.router_optimizer, train_router=True, train_experts=False)

    def _step(self, batch: Batch, optimizer, *, train_router: bool, train_experts: bool, scheduler=None,
              idle: set[int] | frozenset[int] = frozenset()) -> float:
        batch = to_device(batch, model_device(self.model))
        weights = batch.pop(EXAMPLE_WEIGHTS, None)
        for name, param in self.trainable:
            param.requires_grad_((train_router if _is_router(name) else train_experts) and id(param) not in idle)
        try:
            if not self.model.training:  # a whole-model switch: every module then trains (no code sets one alone)
                self.model.train()
            with forward_pass(self.round_aware, batch):
                output = self.model(**batch)
            loss = output.loss if weights is None else \
                (example_loss(self.model, output.logits, batch["labels"]) * weights).mean()
            task_loss = float(loss.detach())
            del output  # the logits are not needed for backward (a vocabulary-sized tensor per token)
            balance = total_balance_loss(self.model)
            if balance is not None:
                loss = loss + self.config.balance_weight * balance
            procedure = self.method.procedure
            extra = procedure.loss_terms(self, train_experts=train_experts, train_router=train_router)
            if extra is not None:
                loss = loss + extra
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for module in self.round_aware:
                module.after_backward()
            procedure.adjust_gradients(self)
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if self.config.grad_clip is not None:
                norm = torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip)  # the norm before clipping
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
            self.last_step = StepFigures(float(optimizer.param_groups[0]["lr"]), float(norm))
            optimizer.step()
            procedure.after_step(self)
            for module in self.round_aware:
                module.after_step()
            if scheduler is not None:
                scheduler.step()
        finally:
            for _, param in self.trainable:
                param.requires_grad_(True)
        return task_loss

    # -- persistence --------------------------------------------------------
    def optimizer_state(self) -> dict[str, object]:
        return {
            "iteration": self.iteration,
            "expert": self.expert_optimizer.state_dict() if self.expert_optimizer else None,
            "router": self.router_optimizer.state_dict() if self.router_optimizer else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
        }

    def load_optimizer_state(self, state: dict[str, object]) -> None:
        self.iteration = int(state["iteration"])
        for target, key in ((self.expert_optimizer, "expert"), (self.router_optimizer, "router"),
                            (self.scheduler, "scheduler")):
            if target is not None and state.get(key) is not None:
                target.load_state_dict(state[key])


def one_cycle_cosine(optimizer: torch.optim.Optimizer, total: int, warmup: int, start: float = 1 / 25,
                     end: float = 1e-4) -> LRScheduler:
    """The one-cycle cosine schedule of CoMiGS App. B.1.2, on each parameter group's own rate r:
    linear warm-up from ``start``·r to r over ``warmup`` steps (torch's ``LinearLR``), then a cosine
    decay to ``end``·r at step ``total``, held there afterwards (:func:`_cosine_decay`), joined by
    torch's ``SequentialLR``. When ``warmup`` reaches ``total`` the decay takes one step."""
    warm_up = LinearLR(optimizer, start_factor=start, end_factor=1.0, total_iters=warmup)
    decay = _cosine_decay(optimizer, steps=max(total - warmup, 1), floor=end)
    return SequentialLR(optimizer, [warm_up, decay], milestones=[warmup])


def cosine_to_tenth(optimizer: torch.optim.Optimizer, total: int) -> LRScheduler:
    """The experts' schedule in the CoMiGS authors' code, ``CosineAnnealingLR(T_max=total,
    eta_min=lr/10)``: a cosine decay of each group's rate r to r/10 at step ``total``, held there
    afterwards (:func:`_cosine_decay`)."""
    return _cosine_decay(optimizer, steps=total, floor=0.1)


def _cosine_decay(optimizer: torch.optim.Optimizer, steps: int, floor: float) -> LRScheduler:
    """A cosine from each group's rate r down to ``floor``·r over ``steps`` steps, then ``floor``·r:
    the decay phase of the warm-up–stable–decay schedule (Hu et al. 2024, MiniCPM), as transformers'
    ``get_wsd_schedule`` computes it (the same factors, bit for bit), without importing transformers'
    optimisation module (it imports peft and bitsandbytes: 1.5 s more for every device process).

    Not torch's ``CosineAnnealingLR``: its floor ``eta_min`` is one rate for every group, where
    FLoRAL's routers train in a group at a rate of their own, and past ``T_max`` it climbs back up."""
    return LambdaLR(optimizer, partial(_cosine_factor, steps=steps, floor=floor))


def _cosine_factor(step: int, *, steps: int, floor: float) -> float:
    """The factor on the rate at ``step`` of :func:`_cosine_decay`."""
    if step >= steps:
        return floor
    progress = float(step) / float(max(1, steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(0.0, factor * (1.0 - floor) + floor)


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {key: value.to(device) for key, value in batch.items()}


def _is_router(name: str) -> bool:
    return "router" in name.split(".")


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Everything a device learns: trainable parameters and the routers' buffers
    (Hermes bias, gradient view and usage counts)."""
    state = {name: param.detach() for name, param in model.named_parameters() if param.requires_grad}
    state.update({name: buffer for name, buffer in model.named_buffers() if _is_router(name)})
    return state


@torch.no_grad()
def predict(model: nn.Module, examples, batch_size: int, regression: bool) -> torch.Tensor:
    """Class indices (or regression scores) of a sequence classifier on ``examples``
    (anything with ``len()`` and ``batch(rows)`` giving model inputs)."""
    model.eval()
    device = model_device(model)
    outputs = []
    for start in range(0, len(examples), batch_size):
        batch = examples.batch(torch.arange(start, min(start + batch_size, len(examples))))
        inputs = to_device({k: v for k, v in batch.items() if k != "labels"}, device)
        logits = model(**inputs).logits.float().cpu()
        outputs.append(logits.squeeze(-1) if regression else logits.argmax(dim=-1))
    return torch.cat(outputs) if outputs else torch.empty(0)
