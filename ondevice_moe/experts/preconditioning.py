"""LoRA gradient preconditioning: FLoRAL App. D, eq. (36).

For ``L = U Vᵀ`` (here ``U = B``, the ``out × r`` matrix, and ``Vᵀ = A``, the
``r × in`` one) the plain gradient step moves ``UVᵀ`` by ``UUᵀG + GVVᵀ``, so a
mixture of LoRAs learns at rates set by their own scales. Eq. (36) rescales
(Tong et al., 2021; Zhang & Pilanci, 2024)::

    G_U ← G_U (VᵀV + εI)⁻¹,    G_V ← G_V (UᵀU + εI)⁻¹

and as ε → 0 the step follows the projections of ``G`` on the column spaces,
at the scale of the base weight's own dynamics. For a ConvLoRA App. D divides
each factor's gradient by the Frobenius norm of the other factor's Gram tensor
instead. ε = 1e-5 and the solve (no explicit inverse) are the authors' code
(zeligism/FLoRAL ``floral/training/precondlora_trainer.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from ondevice_moe.experts.conv_lora import ConvLoRA
from ondevice_moe.experts.lora import LoRA

EPSILON = 1e-5


@torch.no_grad()
def precondition_lora(lora: LoRA, epsilon: float = EPSILON) -> None:
    """Eq. (36) on one LoRA's gradients, in place (nothing to do before a backward pass)."""
    down, up = lora.lora_A, lora.lora_B  # Vᵀ (r × in), U (out × r)
    if down.grad is None or up.grad is None:
        return
    identity = torch.eye(down.shape[0], dtype=down.dtype, device=down.device) * epsilon
    down.grad.copy_(torch.linalg.solve(up.T @ up + identity, down.grad))  # (UᵀU + εI)⁻¹ G_Vᵀ
    up.grad.copy_(torch.linalg.solve(down @ down.T + identity, up.grad.T).T)  # G_U (VᵀV + εI)⁻¹


@torch.no_grad()
def precondition_conv_lora(lora: ConvLoRA, epsilon: float = EPSILON) -> None:
    """App. D for convolutions: each factor's gradient over ``‖Gram of the other factor‖_F``."""
    down, up = lora.down.weight, lora.up.weight  # (r, c_in, …), (c_out, r, …)
    if down.grad is None or up.grad is None:
        return
    down.grad.div_(torch.linalg.norm(torch.einsum("ma...,mb...->ab...", up, up)) + epsilon)
    up.grad.div_(torch.linalg.norm(torch.einsum("an...,bn...->ab...", down, down)) + epsilon)


def low_rank_modules(model: nn.Module) -> list[LoRA | ConvLoRA]:
    """Every LoRA and ConvLoRA of ``model``: what :func:`precondition_gradients` works on, found once
    per model rather than once per step (a walk of the model costs a small model's step a tenth)."""
    return [module for module in model.modules() if isinstance(module, LoRA | ConvLoRA)]


def precondition_gradients(modules: list[LoRA | ConvLoRA], epsilon: float = EPSILON) -> None:
    """Precondition the gradients of ``modules`` (:func:`low_rank_modules` of a model)."""
    for module in modules:
        if isinstance(module, LoRA):
            precondition_lora(module, epsilon)
        else:
            precondition_conv_lora(module, epsilon)


__all__ = ["EPSILON", "low_rank_modules", "precondition_conv_lora", "precondition_gradients", "precondition_lora"]
