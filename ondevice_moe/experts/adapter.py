"""Houlsby bottleneck adapters (Houlsby et al., 2019; Hermes §3.1).

``ΔE(h) = W_up · φ(W_down · h)`` with ``W_down ∈ R^{r×d}``, ``W_up ∈ R^{d×r}``
and ``φ`` = ReLU. ``W_up`` starts at zero, so a fresh adapter adds nothing.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ondevice_moe.experts.lora import Gate, gated_sum


class Adapter(nn.Module):
    """The bottleneck residual ``up(relu(down(h)))`` of one adapter expert."""

    def __init__(self, hidden_size: int, rank: int = 16, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.down = nn.Parameter(torch.empty(rank, hidden_size))
        self.up = nn.Parameter(torch.zeros(hidden_size, rank))
        bound = 1.0 / math.sqrt(hidden_size)
        with torch.no_grad():
            self.down.uniform_(-bound, bound, generator=generator)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        bottleneck = torch.relu(nn.functional.linear(hidden.to(self.down.dtype), self.down))
        return nn.functional.linear(bottleneck, self.up)


class AdapterAfter(nn.Module):
    """A frozen sublayer followed by its adapters: ``y = f(x) + Σ_j g_j · adapter_j(f(x))``.

    Placed after the feed-forward sublayer (Houlsby), before the block's
    dropout / layer norm / residual. ``gates`` maps an adapter's key to the
    router's per-token weight for it, shape ``(…, 1)``; adapters without a gate
    are always on.
    """

    def __init__(self, base: nn.Module, adapters: dict[str, Adapter], gates: dict[str, Gate] | None = None) -> None:
        super().__init__()
        self.base = base
        self.adapters = nn.ModuleDict(adapters)
        self.gates = dict(gates or {})

    def add(self, name: str, adapter: Adapter, gate: Gate | None = None) -> None:
        self.adapters[name] = adapter
        if gate is not None:
            self.gates[name] = gate

    def forward(self, *args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        out = self.base(*args, **kwargs)
        residual = gated_sum({name: adapter(out) for name, adapter in self.adapters.items()}, self.gates)
        return out + residual.to(out.dtype)
