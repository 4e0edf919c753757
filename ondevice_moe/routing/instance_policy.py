"""Flow's routing module ψ (Flow §3, eq. 2 and 4): a per-instance policy over a global and
a local copy of each routed layer.

ψ is a chain of fully connected ``base`` layers on the instance's (flattened) input, with
one ``exit`` after each, ``q^(j) = softmax(ψ_exit^(j)(ψ_base^(j)(x̂)))`` (eq. 2): ``q_0``
picks the global layer, ``q_1`` the local one. The router runs once per forward pass
(:meth:`InstancePolicyRouter.route`, a pre-hook on the network) and each routed layer reads
its own exit through :meth:`InstancePolicyRouter.gate`.

Which path the layers take is the router's ``path``:

* ``policy`` — the soft policy ``q`` while training (eq. 3), its rounded, one-hot version
  ``round(q)`` at inference (§3 "Soft versus Hard Policy");
* ``global`` / ``local`` — every instance on the global (``Acc_g``, eq. 6) or the local
  copies (training ``w_ℓ`` on ``ζ_ℓ``, eq. 1).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

Path = Literal["policy", "global", "local"]
GLOBAL, LOCAL = 0, 1


class InstancePolicyRouter(nn.Module):
    """ψ: ``exits`` exits over a chain of ReLU layers of width ``hidden`` on ``in_features``
    inputs (eq. 2). Shared: FedAvg'd with the global layers (Alg. 1 line 14)."""

    def __init__(self, in_features: int, exits: int, hidden: int, generator: torch.Generator) -> None:
        super().__init__()
        widths = [in_features] + [hidden] * exits
        self.base = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.exits = nn.ModuleList(nn.Linear(hidden, 2) for _ in range(exits))
        with torch.no_grad():
            for layer in (*self.base, *self.exits):
                bound = 1.0 / layer.in_features ** 0.5
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)
        self.path: Path = "policy"
        self.last_q: list[torch.Tensor] = []

    def route(self, inputs: torch.Tensor) -> list[torch.Tensor]:
        """``q^(j)`` for every exit, shape ``(batch, 2)`` each (eq. 2); kept for the layers and
        for the regulariser of eq. 4."""
        hidden = inputs.flatten(1).to(self.base[0].weight.dtype)
        probabilities = []
        for base, exit_ in zip(self.base, self.exits, strict=True):
            hidden = torch.relu(base(hidden))
            probabilities.append(torch.softmax(exit_(hidden), dim=-1))
        self.last_q = probabilities
        return probabilities

    def before_network(self, _network: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        """A forward pre-hook on the network: route its input."""
        self.route(args[0])

    def weights(self, index: int) -> torch.Tensor:
        """The mixing weights layer ``index`` uses now: ``q``, ``round(q)`` or a fixed path."""
        q = self.last_q[index]
        if self.path != "policy":
            chosen = torch.full(q.shape[:1], GLOBAL if self.path == "global" else LOCAL, device=q.device)
            return nn.functional.one_hot(chosen, 2).to(q.dtype)
        if self.training:
            return q
        return nn.functional.one_hot(q.argmax(dim=-1), 2).to(q.dtype)

    def gate(self, index: int) -> Callable[[], torch.Tensor]:
        """Layer ``index``'s weights ``(batch, 2)``, read at every forward pass."""
        return lambda: self.weights(index)


def policy_regulariser(router: InstancePolicyRouter) -> torch.Tensor:
    """``−(1/L) Σ_j log q_0^(j)`` of eq. 4, averaged over the batch: lower when more instances
    take the global layers (γ weighs it in the policy step)."""
    logs = [torch.log(q[:, GLOBAL].clamp_min(torch.finfo(q.dtype).tiny)).mean() for q in router.last_q]
    return -torch.stack(logs).mean()


def instance_policy(model: nn.Module) -> InstancePolicyRouter | None:
    """The model's Flow router, or ``None``."""
    router = getattr(model, "router", None)
    return router if isinstance(router, InstancePolicyRouter) else None
