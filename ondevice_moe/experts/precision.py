"""The dtype the experts' low-rank products run in.

Training and evaluation run an expert's products in the dtype of the layer it adapts — bf16 on a
bf16 base, what ``torch.autocast`` would do — so no float32 copy of a layer's input is kept for
backward; every figure in ``docs/results`` was made so. :func:`products_in` runs them in another
dtype for a while: generation runs them in float32, as PEFT does for adapters on a half-precision
base (``autocast_adapter_dtype``), because a CPU computes one token's small bf16 products
(1 × 576 by 576 × 8 on SmolLM2) about ten times slower than float32 ones (issue 64). The result is
added to the base layer's output in the product dtype and rounded once to the layer's dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

_PRODUCTS: ContextVar[torch.dtype | None] = ContextVar("expert_products", default=None)


def product_dtype(like: torch.Tensor) -> torch.dtype:
    """The dtype of an expert's product on ``like``: ``like``'s own, unless :func:`products_in` chose one."""
    return _PRODUCTS.get() or like.dtype


@contextmanager
def products_in(dtype: torch.dtype) -> Iterator[None]:
    """Run every expert's low-rank products in ``dtype`` inside the ``with`` block."""
    token = _PRODUCTS.set(dtype)
    try:
        yield
    finally:
        _PRODUCTS.reset(token)


def low_rank(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x · weightᵀ`` in :func:`product_dtype` of ``x`` (``weight``: an expert's down-projection, rank × width)."""
    dtype = product_dtype(x)
    return nn.functional.linear(x.to(dtype), weight.to(dtype))
