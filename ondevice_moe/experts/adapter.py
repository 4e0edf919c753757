"""Houlsby bottleneck adapters (Houlsby et al., 2019; Hermes §3.1).

``ΔE(h) = W_up · φ(W_down · h)`` with ``W_down ∈ R^{r×d}``, ``W_up ∈ R^{d×r}``
and ``φ`` = ReLU. ``W_up`` starts at zero, so a fresh adapter adds nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ondevice_moe.experts.lora import Gate, add_product, gated_slices
from ondevice_moe.experts.precision import low_rank


class Adapter(nn.Module):
    """The bottleneck residual ``up(relu(down(h)))`` of one adapter expert, computed in
    the dtype of ``h`` (parameters may stay in fp32, as under ``torch.autocast``; generation
    computes in fp32, :mod:`~ondevice_moe.experts.precision`)."""

    def __init__(self, hidden_size: int, rank: int = 16, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.down = nn.Parameter(torch.empty(rank, hidden_size))
        self.up = nn.Parameter(torch.zeros(hidden_size, rank))
        bound = 1.0 / math.sqrt(hidden_size)
        with torch.no_grad():
            self.down.uniform_(-bound, bound, generator=generator)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        bottleneck = torch.relu(low_rank(hidden, self.down))
        return nn.functional.linear(bottleneck, self.up.to(bottleneck.dtype)).to(hidden.dtype)

    def add_to(self, out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``out + w·adapter(hidden)``, the per-token weight ``w`` (…, 1) applied on the
        bottleneck and the sum fused into one multiply-add, in ``out``'s dtype."""
        bottleneck = torch.relu(low_rank(hidden, self.down))
        if weight is not None:
            bottleneck = bottleneck * weight.to(bottleneck.dtype)
        return add_product(out, bottleneck, self.up)


class AdapterAfter(nn.Module):
    """A frozen sublayer followed by its adapters: ``y = f(x) + Σ_j g_j · adapter_j(f(x))``.

    Placed after the feed-forward sublayer (Houlsby), before the block's
    dropout / layer norm / residual. ``gates`` maps an adapter's key to the
    router's per-token weight for it, shape ``(…, 1)``; adapters without a gate
    are always on. ``fused`` adds them all from two products (:func:`add_adapters`).
    """

    fused = False  # set by ``training.fused_experts``

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
        base_out = self.base(*args, **kwargs)
        gated = [(adapter, self.gates[name]() if name in self.gates else None)
                 for name, adapter in self.adapters.items()]
        if self.fused and len(gated) > 1:
            return add_adapters(base_out, base_out, gated)
        out = base_out
        for adapter, gate in gated:
            out = adapter.add_to(out, base_out, gate)
        return out


def add_adapters(out: torch.Tensor, hidden: torch.Tensor, adapters: Sequence[tuple[Adapter, torch.Tensor | None]]
                 ) -> torch.Tensor:
    """``out + Σ_j w_j·adapter_j(hidden)`` from two products whatever the number of adapters: the
    bottlenecks side by side are one adapter of width ``Σ r_j`` (ReLU acts on each unit alone), each
    slice scaled by its gate ``w_j`` (…, 1); equal to adding them one by one, to float rounding."""
    bottleneck = torch.relu(low_rank(hidden, torch.cat([adapter.down for adapter, _ in adapters], dim=0)))
    bottleneck = gated_slices(bottleneck, [(adapter.down.shape[0], weight) for adapter, weight in adapters])
    return add_product(out, bottleneck, torch.cat([adapter.up for adapter, _ in adapters], dim=1))
