"""The MLP of a transformer block carrying a mixture of LoRA experts.

CoMiGS routes at the MLP (App. B.1.2): each expert is the block's MLP with its
own LoRA on every MLP linear layer, and a token's output is the router-weighted
sum of the experts' outputs. Computed naively that runs the frozen MLP once per
expert. Here the frozen projections run once: the input projections are shared
by all experts (only the LoRA residuals differ), and because the output
projection is linear,

    Σ_j w_j · (W_out a_j + ΔW_out,j a_j) = W_out (Σ_j w_j a_j) + Σ_j w_j ΔW_out,j a_j,

so the result equals the per-expert MLPs exactly, at the cost of one base
MLP plus the experts' activations and low-rank residuals.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ondevice_moe.routing import TokenTopKRouter, UniformRouter

ExpertSet = list[nn.ModuleDict]
MixedForward = Callable[[nn.Module, ExpertSet, torch.Tensor, torch.Tensor], torch.Tensor]


def gpt2_mixed_forward(mlp: nn.Module, experts: ExpertSet, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """GPT-2 MLP ``c_proj(act(c_fc x))`` with per-expert LoRA on ``c_fc`` and ``c_proj``."""
    pre_activation = mlp.c_fc(x)
    activations = [mlp.act(pre_activation + expert["c_fc"](x).to(x.dtype)) for expert in experts]
    out = mlp.c_proj(_weighted_sum(activations, weights))
    for j, (expert, act) in enumerate(zip(experts, activations, strict=True)):
        out = out + weights[..., j : j + 1] * expert["c_proj"](act).to(out.dtype)
    return mlp.dropout(out)


def llama_mixed_forward(mlp: nn.Module, experts: ExpertSet, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """LLaMA MLP ``down(act(gate x) · up x)`` with per-expert LoRA on all three."""
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    activations = [
        mlp.act_fn(gate + expert["gate_proj"](x).to(x.dtype)) * (up + expert["up_proj"](x).to(x.dtype))
        for expert in experts
    ]
    out = mlp.down_proj(_weighted_sum(activations, weights))
    for j, (expert, act) in enumerate(zip(experts, activations, strict=True)):
        out = out + weights[..., j : j + 1] * expert["down_proj"](act).to(out.dtype)
    return out


def _weighted_sum(activations: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    total = weights[..., 0:1] * activations[0]
    for j in range(1, len(activations)):
        total = total + weights[..., j : j + 1] * activations[j]
    return total


class MixtureMLP(nn.Module):
    """A frozen MLP, its LoRA experts (keyed ``shared_0``, ``private_0``, …) and a router.

    After each forward pass ``last_balance_loss`` holds the router's balance
    term and ``last_scores`` the mean routing weight of each expert (the
    "expert scores" of CoMiGS Fig. 4).
    """

    def __init__(
        self,
        base: nn.Module,
        experts: dict[str, nn.ModuleDict],
        router: TokenTopKRouter | UniformRouter,
        mixed_forward: MixedForward,
    ) -> None:
        super().__init__()
        self.base = base
        self.experts = nn.ModuleDict(experts)
        self.router = router
        self._mixed_forward = mixed_forward
        self.last_balance_loss: torch.Tensor | None = None
        self.last_scores: torch.Tensor | None = None

    @property
    def expert_names(self) -> list[str]:
        return list(self.experts.keys())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        routing = self.router(hidden)
        self.last_balance_loss = routing.balance_loss
        self.last_scores = routing.weights.detach().reshape(-1, routing.weights.shape[-1]).float().mean(dim=0)
        return self._mixed_forward(self.base, list(self.experts.values()), routing.weights, hidden)


def mixtures(model: nn.Module) -> list[MixtureMLP]:
    """The model's mixture layers, in depth order."""
    return [module for module in model.modules() if isinstance(module, MixtureMLP)]


def total_balance_loss(model: nn.Module) -> torch.Tensor | None:
    """Mean balance term over the model's mixture layers after a forward pass."""
    losses = [m.last_balance_loss for m in mixtures(model) if m.last_balance_loss is not None]
    return torch.stack(losses).mean() if losses else None
