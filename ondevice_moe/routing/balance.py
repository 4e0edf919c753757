"""Load-balancing losses for top-k routers.

Both take ``probs`` (tokens × experts, the full softmax ``p(x)``) and
``selected`` (tokens × experts, 1 where the expert is among the token's top-k)
and use CoMiGS eq. (7):

    f_j = (1/T) Σ_x 1{j ∈ topk(p(x))},      P_j = (1/T) Σ_x p_j(x).
"""

from __future__ import annotations

import torch


def _dispatch_and_importance(probs: torch.Tensor, selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(f, P)`` of CoMiGS eq. (7), flattened over all tokens."""
    probs = probs.reshape(-1, probs.shape[-1]).float()
    selected = selected.reshape(-1, selected.shape[-1]).float()
    return selected.mean(dim=0), probs.mean(dim=0)


def switch_balance_loss(probs: torch.Tensor, selected: torch.Tensor, top_k: int) -> torch.Tensor:
    """Uniform load balance of Switch Transformers (Fedus et al., 2022, eq. 4).

    ``(n/k) · Σ_j f_j P_j``: the ``1/k`` makes the top-k dispatch fractions sum to
    one, so the loss is 1 when the router spreads tokens evenly, and larger
    otherwise. Its gradient flows through ``P`` only (``f`` is a count).
    """
    f, p = _dispatch_and_importance(probs, selected)
    num_experts = probs.shape[-1]
    return num_experts / top_k * torch.sum(f * p)


def generalist_balance_loss(probs: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Generalist-favoured load balance, CoMiGS eq. (6).

    Expert 0 is the generalist. With ``n`` experts,

        L = 1/((n-1)²+1) · f_0 P_0 + Σ_{j≥1} (n-1)/((n-1)²+1) · f_j P_j,

    which is minimised when the generalist takes half of the routing mass.
    """
    f, p = _dispatch_and_importance(probs, selected)
    n = probs.shape[-1]
    denominator = (n - 1) ** 2 + 1
    coefficients = torch.full((n,), (n - 1) / denominator, device=p.device)
    coefficients[0] = 1.0 / denominator
    return torch.sum(coefficients * f * p)
