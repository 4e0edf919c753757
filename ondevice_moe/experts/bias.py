"""Bias adaptors: FLoRAL §3.2, "adaptive biases ``b + L_b`` with extra biases
``L_b`` initialized to 0" — on every layer that has a bias (a Linear's output
features, a convolution's output channels)."""

from __future__ import annotations

import torch
from torch import nn


class BiasAdaptor(nn.Module):
    """A zero-initialised extra bias ``L_b`` for a layer with ``features`` outputs along ``dim``
    (``-1`` for a Linear, ``1`` — channels — for a convolution)."""

    def __init__(self, features: int, dim: int = -1) -> None:
        super().__init__()
        self.delta = nn.Parameter(torch.zeros(features))
        self.dim = dim

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The residual ``L_b``, shaped to broadcast over ``out`` (the layer's output)."""
        if self.dim == -1:
            return self.delta.to(out.dtype)
        shape = [1] * out.dim()
        shape[self.dim] = -1
        return self.delta.to(out.dtype).view(shape)


__all__ = ["BiasAdaptor"]
