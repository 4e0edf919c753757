"""Sparse top-k softmax, shared by the CoMiGS and Hermes routers."""

from __future__ import annotations

import torch


def top_k_softmax(scores: torch.Tensor, top_k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each row's ``top_k`` scores and softmax them at ``temperature``.

    Returns ``(weights, selected)``: weights are zero outside the top-k and sum
    to one over it (Hermes eq. 8); ``selected`` is the 0/1 mask of the top-k.
    With ``temperature = 1`` on router logits this equals renormalising the
    full softmax over the top-k (CoMiGS).
    """
    top_scores, top_index = scores.topk(top_k, dim=-1)
    top_weights = torch.softmax(top_scores / temperature, dim=-1)
    weights = torch.zeros_like(scores).scatter(-1, top_index, top_weights)
    selected = torch.zeros_like(scores).scatter(-1, top_index, 1.0)
    return weights, selected
