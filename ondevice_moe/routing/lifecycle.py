"""What a routing module does around the training steps and the rounds it takes part in.

Some routers keep state outside the autograd graph: Hermes' router counts the tokens it routes,
keeps a gradient view of its experts and moves a balancing bias after each step (Hermes eq. 5–6);
FLoRAL's client mixture reports its ``π`` each round (FLoRAL Alg. 1 line 12). The trainer and the
device do not know these routers: they call the hooks of :class:`RoundAware` on every module of the
model that derives from it, in model order, and a new router brings its own behaviour by
overriding them. Each hook does nothing unless overridden.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn


class RoundAware:
    """A module (mixed into an ``nn.Module``) that takes part in each training step and round."""

    def begin_round(self) -> None:
        """Before the round's first step (Hermes: usage counts restart, one round's usage per upload)."""

    @contextlib.contextmanager
    def forward_pass(self, batch: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Around one training forward pass on ``batch`` (Hermes: count only the tokens its
        attention mask keeps)."""
        yield

    def after_backward(self) -> None:
        """After the backward pass, before gradients are clipped and applied (Hermes: drop the
        gradients of unselected experts, update the gradient view)."""

    def after_step(self) -> None:
        """After the optimiser's step (Hermes: loss-free balancing of the bias)."""

    def round_metrics(self) -> dict[str, float]:
        """Figures for the round's ``train`` record (FLoRAL: ``pi_<c>``)."""
        return {}

    def kept_home(self) -> set[int]:
        """Where the method lets routers choose what travels (``Sharing.selected_only``): ids of the
        expert parameters that stay on the device this round (Hermes §4.3: all but the block's
        ``top_k`` most used experts)."""
        return set()

    def upload_records(self, name_of: Mapping[int, str]) -> dict[str, dict[str, float]]:
        """Where routers choose what travels: the records sent with the experts they chose, by record
        name (Hermes: ``usage``, tokens routed per expert tensor); ``name_of``: parameter id → name."""
        return {}


def round_aware(model: nn.Module) -> list[RoundAware]:
    """The model's modules that take part in steps and rounds, in model order."""
    return [module for module in model.modules() if isinstance(module, RoundAware)]


@contextlib.contextmanager
def forward_pass(modules: list[RoundAware], batch: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Every module's :meth:`RoundAware.forward_pass` around one forward pass."""
    with contextlib.ExitStack() as stack:
        for module in modules:
            stack.enter_context(module.forward_pass(batch))
        yield


def begin_round(model: nn.Module) -> None:
    """Tell the model's round-aware modules that a round begins."""
    for module in round_aware(model):
        module.begin_round()


def routed_upload(model: nn.Module, tensors: dict[str, torch.Tensor]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, float]]]:
    """``tensors`` without the experts the model's routers keep home this round, and the records the
    routers send with the rest (each record's entries only for tensors that travel)."""
    modules = round_aware(model)
    name_of = {id(param): name for name, param in model.named_parameters()}
    home = {name_of[ident] for module in modules for ident in module.kept_home() if ident in name_of}
    kept = {name: tensor for name, tensor in tensors.items() if name not in home}
    records: dict[str, dict[str, float]] = {}
    for module in modules:
        for record, entries in module.upload_records(name_of).items():
            records.setdefault(record, {}).update({name: value for name, value in entries.items() if name in kept})
    return kept, records


def round_metrics(model: nn.Module) -> dict[str, float]:
    """The round's figures of every round-aware module of the model."""
    figures: dict[str, float] = {}
    for module in round_aware(model):
        figures.update(module.round_metrics())
    return figures
