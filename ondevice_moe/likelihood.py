"""A language model's per-block likelihoods: the NLLs behind test perplexity, their
standard error, and the per-block losses FedSoft scores its centres with."""

from __future__ import annotations

import math

import torch
from torch import nn

from ondevice_moe.models.devices import model_device


@torch.no_grad()
def block_nll(model: nn.Module, blocks: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Summed next-token negative log-likelihood of each block, shape ``(num_blocks,)``."""
    model.eval()
    device = model_device(model)
    sums = []
    for start in range(0, blocks.shape[0], batch_size):
        batch = blocks[start : start + batch_size].to(device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        nll = nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
        sums.append(nll.sum(dim=1).cpu())
    return torch.cat(sums)


def perplexity_of(nll: torch.Tensor, context_length: int) -> float:
    """exp(mean NLL per predicted token) of blocks whose summed NLLs are ``nll``."""
    return math.exp(float(nll.sum()) / (nll.numel() * (context_length - 1)))


def nll_standard_error(nll: torch.Tensor, context_length: int) -> float | None:
    """Standard error of the mean per-token NLL, over the blocks (their per-token means);
    ``None`` for fewer than two blocks.

    A relative perplexity difference δ is a NLL difference of about δ, so a
    1 % perplexity gap is resolved when this is well under 0.01."""
    if nll.numel() < 2:
        return None
    per_token = nll.double() / (context_length - 1)
    return float(per_token.std() / math.sqrt(nll.numel()))
