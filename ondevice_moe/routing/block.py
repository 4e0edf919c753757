"""Routing on a block's input, for experts that sit at several places in the block.

Hermes §4.2 routes each token once per block, on the block input ``h^(l-1)``
(eq. 4), and scales every expert's residual where that expert sits — LoRA
on the attention projections, an adapter after the FFN, a prefix inside
attention — by the token's weight for it (eq. 9). :class:`BlockRouter` runs
any router (``uniform``, ``token-topk``, ``hermes``, ``sigmoid``) there and
keeps the weights of the current forward pass for the experts' gates.
"""

from __future__ import annotations

import torch
from torch import nn


class BlockRouter(nn.Module):
    """Wraps a router; after each forward pass ``current`` holds the per-token weights
    ``(…, n)``, ``last_balance_loss`` the router's balance term and ``last_scores``
    the mean weight of each expert (CoMiGS Fig. 4 "expert scores")."""

    def __init__(self, router: nn.Module, expert_names: list[str]) -> None:
        super().__init__()
        self.router = router
        self.expert_names = list(expert_names)
        self.current: torch.Tensor | None = None
        self.last_balance_loss: torch.Tensor | None = None
        self.last_scores: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> None:
        routing = self.router(hidden)
        self.current = routing.weights
        self.last_balance_loss = routing.balance_loss
        self.last_scores = routing.weights.detach().reshape(-1, routing.weights.shape[-1]).float().mean(dim=0)

    def gate(self, name: str) -> ExpertGate:
        return ExpertGate(self, self.expert_names.index(name))


class ExpertGate:
    """Callable giving one expert's per-token routing weight, shape ``(…, 1)``.

    Held by expert sites as a plain attribute (not a submodule), so the router
    stays registered once, under its block.
    """

    def __init__(self, router: BlockRouter, index: int) -> None:
        self.router = router
        self.index = index

    def __call__(self) -> torch.Tensor | None:
        current = self.router.current
        return None if current is None else current[..., self.index : self.index + 1]


def route_block_input(block: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: route on the block input before the block runs (Hermes eq. 4)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    block.router(hidden)
