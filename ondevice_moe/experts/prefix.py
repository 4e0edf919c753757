"""Prefix experts: learned keys and values prepended in a layer's attention
(Li & Liang, 2021; Hermes §3.1), gated per token by a router.

``ΔE(h) = Attn(Q, [K_p; K], [V_p; V]) − Attn(Q, K, V)``. A router weight
``w`` scales the prefix's share of the attention: adding ``log w`` to the
prefix columns of the attention scores gives, with ``λ`` the attention mass
on the prefix,

    softmax over [K_p; K] = (1 − λ_w)·Attn(Q, K, V) + λ_w·Attn(Q, K_p, V_p),
    λ_w = w·Z_p / (Z + w·Z_p),

so ``w = 0`` is the base model, ``w = 1`` is plain prefix attention, and it all
stays one SDPA call. It is implemented as an attention function registered
with transformers' ``AttentionInterface`` (one hook for GPT-2, LLaMA and
BERT/RoBERTa), not through PEFT's ``past_key_values`` route, which cannot be
gated and breaks with gradient checkpointing.
"""

from __future__ import annotations

import math

import torch
from torch import nn

ATTENTION_NAME = "ondevice_prefix"


class Prefix(nn.Module):
    """``l_p`` learned key and value vectors per key/value head of one layer."""

    def __init__(self, num_kv_heads: int, length: int, head_dim: int, generator: torch.Generator | None = None):
        super().__init__()
        self.key = nn.Parameter(torch.empty(num_kv_heads, length, head_dim))
        self.value = nn.Parameter(torch.empty(num_kv_heads, length, head_dim))
        with torch.no_grad():
            std = 1.0 / math.sqrt(head_dim)
            self.key.normal_(0.0, std, generator=generator)
            self.value.normal_(0.0, std, generator=generator)


def prefix_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SDPA attention with the module's gated prefix experts (if any) prepended."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # a transformers model calls this

    prefixes = getattr(module, "prefix", None)
    if prefixes is None or len(prefixes) == 0:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    batch, _, q_len, _ = query.shape
    k_len = key.shape[2]
    allowed = _allowed(module, attention_mask, q_len, k_len, query.device)
    negative = torch.finfo(query.dtype).min
    base_bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device).masked_fill(~allowed, negative)
    gates = getattr(module, "prefix_gates", {})
    prefix_keys, prefix_values, prefix_bias = [], [], []
    for name, prefix in prefixes.items():
        gate = gates[name]() if name in gates else None
        prefix_keys.append(prefix.key.to(key.dtype).unsqueeze(0).expand(batch, -1, -1, -1))
        prefix_values.append(prefix.value.to(value.dtype).unsqueeze(0).expand(batch, -1, -1, -1))
        length = prefix.key.shape[1]
        if gate is None:
            bias = torch.zeros(batch, 1, q_len, length, dtype=query.dtype, device=query.device)
        else:  # log of the router weight of each query token; log 0 = -inf masks the prefix out
            weight = gate.squeeze(-1)[:, -q_len:].to(torch.float32)
            bias = torch.log(weight).clamp(min=negative).to(query.dtype)[:, None, :, None].expand(-1, 1, -1, length)
        prefix_bias.append(bias)
    mask = torch.cat([*prefix_bias, base_bias.expand(batch, -1, -1, -1)], dim=-1)
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(
        module, query, torch.cat([*prefix_keys, key], dim=2), torch.cat([*prefix_values, value], dim=2), mask,
        scaling=scaling, dropout=dropout, is_causal=False, **kwargs,
    )


def _allowed(module: nn.Module, mask: torch.Tensor | None, q_len: int, k_len: int, device) -> torch.Tensor:
    """Which (query, key) pairs of the base sequence may attend, as a 4-D bool mask."""
    if mask is None:
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
        if getattr(module, "is_causal", False) and q_len > 1:
            allowed = allowed.tril(k_len - q_len)
        return allowed[None, None]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def register_prefix_attention() -> str:
    """Register the prefix-aware attention (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, prefix_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
