"""Attaching a layout to a model: each mixing's attacher, by name (``Layout.mixing``), one module each."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ondevice_moe.experts import LoRA
from ondevice_moe.experts.adapter import Adapter
from ondevice_moe.experts.layer import LayerAdaptor
from ondevice_moe.experts.layer_copy import RoutedLayer
from ondevice_moe.experts.prefix import Prefix
from ondevice_moe.layout.block_mixture import attach_block_mixture
from ondevice_moe.layout.building import ExpertBuilder, frozen_copy
from ondevice_moe.layout.client_mixture import EnsembleNet, attach_client_mixture
from ondevice_moe.layout.layer_copies import attach_layer_copies
from ondevice_moe.layout.mlp_mixture import attach_mlp_mixture
from ondevice_moe.layout.spec import Layout
from ondevice_moe.mixture import MixtureMLP
from ondevice_moe.routing import ClientMixtureRouter, ClientRouter, TokenTopKRouter
from ondevice_moe.routing.block import BlockRouter
from ondevice_moe.routing.hermes import HermesRouter
from ondevice_moe.routing.instance_policy import InstancePolicyRouter

Attacher = Callable[[nn.Module, Layout, ExpertBuilder, tuple[str, ...]], None]
MIXINGS: dict[str, Attacher] = {
    "mlp": attach_mlp_mixture,
    "block": attach_block_mixture,
    "every-layer": attach_client_mixture,
    "ensemble": attach_client_mixture,
    "layer-copies": attach_layer_copies,
}


def attach_layout(base_model: nn.Module, layout: Layout, *, seed: int, user: int = 0,
                  own: tuple[str, ...] = ()) -> nn.Module:
    """A copy of ``base_model`` (sharing its frozen weights, except the modules in
    ``own``) with ``layout``'s experts and routers, put in by the layout's mixing (:data:`MIXINGS`).

    Shared experts start identical on every device (their initialisation
    depends on the seed and the expert's place only); private experts differ per ``user``.
    """
    model = frozen_copy(base_model, own)
    device = next(base_model.parameters()).device
    MIXINGS[layout.mixing](model, layout, ExpertBuilder(layout, getattr(model, "config", None), seed, user), own)
    move_experts(model, device)
    return model


def move_experts(model: nn.Module, device: torch.device) -> None:
    """Put experts and routers where the base runs (they are built on the CPU from seeded generators)."""
    if device.type == "cpu":
        return
    for module in model.modules():
        if isinstance(module, LoRA | Adapter | Prefix | BlockRouter | HermesRouter | TokenTopKRouter | ClientRouter
                      | LayerAdaptor | ClientMixtureRouter | EnsembleNet | RoutedLayer | InstancePolicyRouter):
            module.to(device)


def routing_sites(model: nn.Module) -> list[MixtureMLP | BlockRouter]:
    """The model's routing sites (MLP mixtures and block routers), in depth order."""
    return [m for m in model.modules() if isinstance(m, MixtureMLP | BlockRouter)]


def total_balance_loss(model: nn.Module) -> torch.Tensor | None:
    """Mean balance term over the model's routing sites after a forward pass."""
    losses = [s.last_balance_loss for s in routing_sites(model) if s.last_balance_loss is not None]
    return torch.stack(losses).mean() if losses else None
