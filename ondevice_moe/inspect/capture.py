"""What a user's routers decide on one text: captured with forward hooks on the routers.

Per-token routers (CoMiGS's ``token-topk``, Hermes's dual-view router) give every token a
weight per expert at every routing site; the page colours each token by the expert with the
largest weight (CoMiGS Fig. 6–7). Client-level routers (FLoRAL's ``client-mixture``,
FDLoRA's fitted weights) give one vector per device, the same for every token.
Flow's ``instance-policy`` router gives each instance of a small task a probability ``q_0`` of
the global copy at every routed layer (Flow eq. 2), which the router keeps after each pass.
The model runs once, as it always does: the hooks only read each router's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ondevice_moe.layout import routing_sites
from ondevice_moe.routing import ClientRouter, Routing, TokenTopKRouter, client_mixture
from ondevice_moe.routing.hermes import HermesRouter
from ondevice_moe.routing.instance_policy import GLOBAL, instance_policy

TOKEN_ROUTERS = (TokenTopKRouter, HermesRouter)


@dataclass(frozen=True)
class TokenRouting:
    """``weights[layer, token, expert]``: each site's routing weights for each token of one text."""

    tokens: list[str]
    experts: list[str]
    weights: np.ndarray

    @property
    def chosen(self) -> np.ndarray:
        """The expert with the largest weight, per layer and token (ties go to the first)."""
        return self.weights.argmax(axis=-1)


def site_routers(model: nn.Module) -> list[nn.Module]:
    """The router of every routing site (MLP mixtures and block routers), in depth order."""
    return [site.router for site in routing_sites(model)]


def routes_tokens(model: nn.Module) -> bool:
    """Whether the model's routers weigh experts token by token (and hold more than one expert)."""
    routers = site_routers(model)
    return bool(routers) and all(isinstance(router, TOKEN_ROUTERS) for router in routers)


@torch.no_grad()
def capture_token_routing(model: nn.Module, input_ids: torch.Tensor, tokens: list[str],
                          experts: list[str]) -> TokenRouting:
    """Run ``model`` once on ``input_ids`` (one sequence, shape ``(T,)``) and keep every router's weights."""
    captured: list[torch.Tensor] = []

    def keep(_router: nn.Module, _inputs: tuple, routing: Routing) -> None:
        captured.append(routing.weights.detach().float().reshape(-1, routing.weights.shape[-1]).cpu())

    handles = [router.register_forward_hook(keep) for router in site_routers(model)]
    try:
        device = next(model.parameters()).device
        ids = input_ids.reshape(1, -1).to(device)
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for handle in handles:
            handle.remove()
    return TokenRouting(tokens, experts, torch.stack(captured).numpy())


def client_weights(model: nn.Module) -> dict[str, list[float]] | None:
    """Client-level mixing weights, one vector for the device: FLoRAL's ``π`` (the same at every
    layer, keyed ``all layers``), or FDLoRA's fitted weights per layer; ``None`` for other routers."""
    pi = client_mixture(model)
    if pi is not None:
        return {"all layers": pi}
    routers = site_routers(model)
    if routers and all(isinstance(router, ClientRouter) for router in routers):
        return {f"layer {index}": [float(w) for w in router.mix] for index, router in enumerate(routers)}
    return None


@torch.no_grad()
def capture_instance_policy(model: nn.Module, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    """``q_0[exit, instance]``: Flow's soft probability of the global copy (eq. 2) at each exit
    (routed layer, or block of a Hugging Face model), read by routing the batch ``inputs`` as
    the model receives it. A causal language model routes every position on its context: an
    instance's value is its last position's, the route that has read the whole block."""
    router = instance_policy(model)
    device = next(model.parameters()).device
    shares = router.route_inputs({key: value.to(device) for key, value in inputs.items()})
    return torch.stack([q[:, -1, GLOBAL] if q.dim() == 3 else q[:, GLOBAL] for q in shares]).float().cpu().numpy()
