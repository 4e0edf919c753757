"""The token and block routers a mixing builds, by router kind (``RouterSpec.kind``): one factory each.
The client-level routers (``client-mixture``, ``instance-policy``) belong to their mixings."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ondevice_moe.layout.spec import Layout
from ondevice_moe.routing import ClientRouter, TokenTopKRouter, UniformRouter
from ondevice_moe.routing.hermes import HermesRouter

RouterFactory = Callable[[Layout, int, torch.Generator], nn.Module]


def _dual_view(layout: Layout, hidden_size: int, generator: torch.Generator) -> nn.Module:
    """Hermes eq. (4)–(8) (``hermes``, top-k) or FedUniPELT's dense sigmoid gates (``sigmoid``)."""
    spec, names = layout.router, layout.expert_names
    return HermesRouter(hidden_size, tuple(names), min(spec.top_k, len(names)) if spec.kind == "hermes"
                        else len(names), spec.temperature, spec.gamma, spec.bias_rate, spec.gradient_ema,
                        spec.use_feature, spec.use_gradient, "sigmoid" if spec.kind == "sigmoid" else "hermes",
                        generator)


def _client(layout: Layout, hidden_size: int, generator: torch.Generator) -> nn.Module:
    """One weight per expert for the whole device, set by the method (FDLoRA)."""
    return ClientRouter(len(layout.expert_names))


def _token_topk(layout: Layout, hidden_size: int, generator: torch.Generator) -> nn.Module:
    """CoMiGS's linear gate, softmax, top-k renormalised (eq. 6–7); one expert needs no gate."""
    count = len(layout.expert_names)
    if count == 1:
        return UniformRouter(count)
    return TokenTopKRouter(hidden_size, count, min(layout.router.top_k, count), layout.router.balance, generator)


def _uniform(layout: Layout, hidden_size: int, generator: torch.Generator) -> nn.Module:
    """Fixed equal weights (``uniform``; ``none`` where a mixing needs weights at all)."""
    return UniformRouter(len(layout.expert_names))


ROUTERS: dict[str, RouterFactory] = {"hermes": _dual_view, "sigmoid": _dual_view, "client": _client,
                                     "token-topk": _token_topk}


def make_router(layout: Layout, hidden_size: int, generator: torch.Generator) -> nn.Module:
    """The router ``layout.router.kind`` names (uniform weights for a kind without a factory)."""
    return ROUTERS.get(layout.router.kind, _uniform)(layout, hidden_size, generator)
