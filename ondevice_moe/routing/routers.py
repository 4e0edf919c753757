"""Token-level routers.

:class:`TokenTopKRouter` is the CoMiGS router (§2, App. B.1.2): one linear
layer on the MLP input, a softmax over the user's experts, the top-k kept and
renormalised. :class:`UniformRouter` mixes experts with fixed equal weights;
the baselines without routing (Local, FedAvg, ...) use it so that they hold the
same two LoRA modules as CoMiGS-1G1S.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ondevice_moe.routing.balance import generalist_balance_loss, switch_balance_loss
from ondevice_moe.routing.topk import top_k_softmax

BalanceForm = Literal["uniform", "generalist"]


@dataclass
class Routing:
    """One routing decision for a batch of tokens.

    ``weights`` (…, n) are the mixing weights (zero outside the top-k),
    ``balance_loss`` is the un-weighted load-balancing term (zero when the
    router has nothing to balance).
    """

    weights: torch.Tensor
    balance_loss: torch.Tensor


class UniformRouter(nn.Module):
    """Every token takes every expert with weight ``1/n``; nothing to learn."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts

    def forward(self, hidden: torch.Tensor) -> Routing:
        shape = (*hidden.shape[:-1], self.num_experts)
        weights = hidden.new_full(shape, 1.0 / self.num_experts)
        return Routing(weights=weights, balance_loss=hidden.new_zeros(()))


class TokenTopKRouter(nn.Module):
    """Linear gate → softmax → top-k → renormalise (CoMiGS App. B.1.2).

    The gate starts at zero, so a fresh router weighs the experts equally.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int = 2,
        balance_form: BalanceForm = "uniform",
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and the number of experts ({num_experts}), got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.balance_form = balance_form
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        nn.init.zeros_(self.gate.weight)

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = self.gate(hidden.to(self.gate.weight.dtype)).float()
        probs = torch.softmax(logits, dim=-1)
        # The softmax over the top-k logits is the full softmax renormalised over the top-k.
        weights, selected = top_k_softmax(logits, self.top_k)
        if self.balance_form == "generalist":
            balance = generalist_balance_loss(probs, selected)
        else:
            balance = switch_balance_loss(probs, selected, self.top_k)
        return Routing(weights=weights.to(hidden.dtype), balance_loss=balance)
