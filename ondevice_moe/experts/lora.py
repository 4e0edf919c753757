"""Low-rank adaptation (LoRA) experts with rank-stabilised scaling.

CoMiGS eq. (5): ``W = W0 + γ·BA`` with ``γ = α/√r`` (rsLoRA, Kalajdzievski 2023);
``rank_stabilised=False`` gives the original ``γ = α/r`` (Hu et al., 2022).
``A`` has shape ``(r, in)`` and ``B`` shape ``(out, r)`` as in HF PEFT, so a
user's experts export to PEFT's file format without transposes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

Gate = Callable[[], torch.Tensor | None]


def linear_features(layer: nn.Module) -> tuple[int, int]:
    """Return ``(in_features, out_features)`` of a Linear, GPT-2 Conv1D or bnb layer."""
    if isinstance(layer, Conv1D):
        fan_in, fan_out = layer.weight.shape
        return int(fan_in), int(fan_out)
    if hasattr(layer, "in_features") and hasattr(layer, "out_features"):
        return int(layer.in_features), int(layer.out_features)
    raise TypeError(f"cannot attach LoRA to {type(layer).__name__}: not a linear layer")


class LoRA(nn.Module):
    """The residual ``γ·B(A x)`` of one low-rank expert on one linear layer.

    ``B`` starts at zero, so a fresh expert leaves the base output unchanged.
    ``generator`` makes the initialisation of ``A`` reproducible: experts that
    the server averages start identical on every device.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int = 8,
        alpha: float = 16.0,
        generator: torch.Generator | None = None,
        rank_stabilised: bool = True,
    ) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / math.sqrt(rank) if rank_stabilised else alpha / rank  # CoMiGS eq. (5)
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        # Same bound as nn.init.kaiming_uniform_(a=√5), the init PEFT uses for A.
        bound = 1.0 / math.sqrt(in_features)
        with torch.no_grad():
            self.lora_A.uniform_(-bound, bound, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.linear(x.to(self.lora_A.dtype), self.lora_A)
        return nn.functional.linear(hidden, self.lora_B) * self.scaling


class LoRAAdaptedLinear(nn.Module):
    """A frozen linear layer plus the sum of its LoRA adapters, keyed by role.

    The adapter key (``shared``/``private``) carries the role into parameter
    names, e.g. ``attn.c_attn.adapters.shared.lora_A``. ``gate``, when given,
    returns the router's per-token weight for this expert, shape ``(…, 1)``
    (Hermes eq. 9); without it every token takes the adapters in full.
    """

    def __init__(self, base: nn.Module, adapters: dict[str, LoRA], gate: Gate | None = None) -> None:
        super().__init__()
        self.base = base
        self.adapters = nn.ModuleDict(adapters)
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        residual = sum(adapter(x) for adapter in self.adapters.values())
        weight = self.gate() if self.gate is not None else None
        if weight is not None:
            residual = weight * residual
        return out + residual.to(out.dtype)
