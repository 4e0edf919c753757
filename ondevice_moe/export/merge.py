"""LoRA experts added with fixed weights, as one LoRA.

LoRA experts that read the same input and are added with weights no input changes —
under a ``uniform`` router (``w_j = 1/n``) or none (``w_j = 1``) — are one LoRA of rank
``Σ r_j`` on that layer, exactly:

    Σ_j w_j γ_j B_j A_j x = [w_1 γ_1 B_1, …, w_n γ_n B_n] [A_1; …; A_n] x.

That is the whole model where the experts sit side by side on a layer (``mixing: block``).
An MLP mixture (``mixing: mlp``: CoMiGS and its baselines, FedAvg's two experts among
them) is not: its output is ``Σ_j w_j MLP_j(x)``, and each expert's MLP runs the
nonlinearity between its input and output LoRAs, so no LoRA on the MLP's layers equals
it, even with fixed weights; the merge is then the closest PEFT form, and
:mod:`~ondevice_moe.export.mixture_gap` measures how close.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ondevice_moe.experts import LoRA, LoRAAdaptedLinear
from ondevice_moe.mixture import MixtureMLP
from ondevice_moe.routing import UniformRouter
from ondevice_moe.routing.block import ExpertGate


@dataclass(frozen=True)
class ExpertLoRA:
    """One LoRA module of an expert: the base module it adapts (``target``), the expert's name,
    the weight every token gives it (``None`` where a router weighs it per token) and whether
    it sits in an MLP mixture of several experts (where no merge is exact)."""

    target: str
    expert: str
    lora: LoRA
    weight: float | None
    in_mlp_mixture: bool


def expert_loras(model: nn.Module) -> Iterator[ExpertLoRA]:
    """Every LoRA module of every expert of ``model``, with its fixed weight where it has one."""
    for path, module in model.named_modules():
        if isinstance(module, MixtureMLP):
            weights = _fixed_weights(module.router, len(module.experts))
            for index, (name, expert) in enumerate(module.experts.items()):
                for linear, lora in expert.items() if isinstance(expert, nn.ModuleDict) else ():
                    weight = None if weights is None else weights[index]
                    yield ExpertLoRA(f"{path}.{linear}", name, lora, weight, len(module.experts) > 1)
        elif isinstance(module, LoRAAdaptedLinear):
            for name, lora in module.adapters.items():
                yield ExpertLoRA(path, name, lora, _gate_weight(module.gates.get(name)), False)


def merged_lora(loras: Sequence[tuple[LoRA, float]]) -> LoRA:
    """One LoRA equal to ``Σ_j w_j γ_j B_j A_j`` for ``(LoRA_j, w_j)``: the ranks side by side,
    each expert's weight and scaling folded into its ``B`` (the merged scaling is 1)."""
    first = loras[0][0]
    merged = LoRA(first.lora_A.shape[1], first.lora_B.shape[0], sum(lora.rank for lora, _ in loras), 1.0)
    merged.scaling = 1.0
    with torch.no_grad():
        merged.lora_A.copy_(torch.cat([lora.lora_A for lora, _ in loras]))
        merged.lora_B.copy_(torch.cat([lora.lora_B * lora.scaling * weight for lora, weight in loras], dim=1))
    return merged.to(first.lora_A.device)


def _fixed_weights(router: nn.Module, experts: int) -> list[float] | None:
    """What a router gives each of its ``experts`` for every token, where no input changes it."""
    return [1.0 / experts] * experts if isinstance(router, UniformRouter) else None


def _gate_weight(gate: object | None) -> float | None:
    """An expert's weight on a layer: 1 without a gate, ``1/n`` under a block's uniform router."""
    if gate is None:
        return 1.0
    if isinstance(gate, ExpertGate) and isinstance(gate.router.router, UniformRouter):
        return 1.0 / gate.router.router.num_experts
    return None
