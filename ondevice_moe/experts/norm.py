"""Normalisation adaptors: FLoRAL App. F.2.

A normalisation layer computes ``γ ⊙ ĥ (+ β)``; its adaptor ``L_γ`` has the
shape of ``γ``, starts at zero, and makes the output ``(γ + L_γ) ⊙ ĥ (+ β)``:
the residual is ``L_γ ⊙ ĥ``. ``ĥ`` is recomputed with the layer's own
statistics (a batch norm's running statistics in evaluation, the batch's in
training, without updating the running ones twice). The paper's
re-parameterised Batch-NorA (eq. 42) is exploratory there and is not built.
"""

from __future__ import annotations

import torch
from torch import nn

NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer with a learnable scale: LayerNorm, GroupNorm, BatchNorm, or an RMSNorm
    (PyTorch's, or a Hugging Face model's ``*RMSNorm`` with ``weight`` and ``variance_epsilon``)."""
    if isinstance(module, (*NORM_TYPES, nn.RMSNorm)):
        return getattr(module, "weight", None) is not None
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def normalised(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``ĥ``: ``norm``'s input normalised as ``norm`` does it, before its scale and shift."""
    if isinstance(norm, nn.LayerNorm):
        return nn.functional.layer_norm(x, norm.normalized_shape, None, None, norm.eps)
    if isinstance(norm, nn.GroupNorm):
        return nn.functional.group_norm(x, norm.num_groups, None, None, norm.eps)
    if isinstance(norm, nn.modules.batchnorm._BatchNorm):
        use_batch = norm.training or norm.running_mean is None
        return nn.functional.batch_norm(x, None if use_batch else norm.running_mean,
                                        None if use_batch else norm.running_var, None, None, use_batch, 0.0, norm.eps)
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or torch.finfo(x.dtype).eps
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


class NormAdaptor(nn.Module):
    """The residual ``L_γ ⊙ ĥ`` of one normalisation adaptor on ``norm``."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = [norm]  # a plain list: the base layer is not this module's child
        self.delta = nn.Parameter(torch.zeros_like(norm.weight, dtype=torch.float32))

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        hat = normalised(self.norm[0], x)
        scale = self.delta.to(out.dtype)
        if hat.dim() > 2 and isinstance(self.norm[0], nn.GroupNorm | nn.modules.batchnorm._BatchNorm):
            scale = scale.view(1, -1, *([1] * (hat.dim() - 2)))  # per channel
        return scale * hat


__all__ = ["NORM_TYPES", "NormAdaptor", "is_norm", "normalised"]
