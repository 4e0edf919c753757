"""Convolution LoRA (ConvLoRA) experts: FLoRAL §3.2 and App. F.1.

A ConvLoRA adds ``L * x = U * (V * x)`` to a frozen (or trained) ``Conv2d``:
two convolutions through ``r`` channels, the second starting at zero so a
fresh expert leaves the layer unchanged. Two forms:

* ``balanced-2d`` (App. F.1, eq. 40, "channel+filter-wise" with ``r_f = 1``;
  the paper's choice): ``V`` is a ``(1, k2)`` convolution ``c_in → r`` and
  ``U`` a ``(k1, 1)`` convolution ``r → c_out``, each taking the base's
  stride, padding and dilation along its own axis; ``(c_in·k2 + c_out·k1)·r``
  parameters.
* ``channel`` (eq. 38, channel-wise): ``V`` is a ``1×1`` convolution
  ``c_in → r`` and ``U`` a convolution ``r → c_out`` with the base's kernel,
  stride, padding and dilation; ``(c_out·k1·k2 + c_in)·r`` parameters.

The rank follows the relative budget ρ (§3.2, App. F.1): the largest ``r``
with ``(parameters per unit of rank)·r ≤ ρ·c_in·c_out·k1·k2``, at least 1.
The authors' code (zeligism/FLoRAL ``floral/floral/conv.py``) counts
``c·len(kernel)`` instead of ``c·k`` per unit of rank; we follow the paper.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

ConvForm = Literal["balanced-2d", "channel"]
CONV_FORMS: tuple[str, ...] = ("balanced-2d", "channel")


def relative_rank(budget: float, base_params: int, params_per_rank: int, minimum: int = 1) -> int:
    """FLoRAL §3.2: ``r = max(minimum, ⌊ρ·(base parameters)/(adaptor parameters per unit of rank)⌋)``;
    for a linear ``m × n`` layer this is ``⌊ρ·mn/(m + n)⌋``."""
    return max(minimum, math.floor(budget * base_params / params_per_rank))


class ConvLoRA(nn.Module):
    """The residual ``U * (V * x)`` of one ConvLoRA expert on ``base`` (a ``Conv2d``)."""

    def __init__(self, base: nn.Conv2d, budget: float, form: ConvForm = "balanced-2d",
                 generator: torch.Generator | None = None, min_rank: int = 1) -> None:
        super().__init__()
        if form not in CONV_FORMS:
            raise ValueError(f"unknown ConvLoRA form '{form}', use one of {CONV_FORMS}")
        if base.groups != 1 or base.padding_mode != "zeros":
            raise ValueError("ConvLoRA adapts plain convolutions (groups = 1, zero padding)")
        c_in, c_out = base.in_channels, base.out_channels
        (k1, k2), (s1, s2), (p1, p2), (d1, d2) = base.kernel_size, base.stride, base.padding, base.dilation
        if isinstance(base.padding, str):
            raise ValueError("ConvLoRA needs numeric padding on the base convolution")
        self.form = form
        if form == "balanced-2d":
            per_rank = c_in * k2 + c_out * k1
            first = dict(kernel_size=(1, k2), stride=(1, s2), padding=(0, p2), dilation=(1, d2))
            second = dict(kernel_size=(k1, 1), stride=(s1, 1), padding=(p1, 0), dilation=(d1, 1))
        else:
            per_rank = c_out * k1 * k2 + c_in
            first = dict(kernel_size=1)
            second = dict(kernel_size=(k1, k2), stride=(s1, s2), padding=(p1, p2), dilation=(d1, d2))
        self.rank = relative_rank(budget, c_in * c_out * k1 * k2, per_rank, min_rank)
        self.down = nn.Conv2d(c_in, self.rank, bias=False, **first)
        self.up = nn.Conv2d(self.rank, c_out, bias=False, **second)
        fan_in = c_in * self.down.kernel_size[0] * self.down.kernel_size[1]
        bound = 1.0 / math.sqrt(fan_in)
        with torch.no_grad():
            self.down.weight.uniform_(-bound, bound, generator=generator)
            self.up.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


__all__ = ["CONV_FORMS", "ConvForm", "ConvLoRA", "relative_rank"]
