"""Low-rank adaptation (LoRA) experts with rank-stabilised scaling.

CoMiGS eq. (5): ``W = W0 + γ·BA`` with ``γ = α/√r`` (rsLoRA, Kalajdzievski 2023);
``rank_stabilised=False`` gives the original ``γ = α/r`` (Hu et al., 2022).
``A`` has shape ``(r, in)`` and ``B`` shape ``(out, r)`` as in HF PEFT, so a
user's experts export to PEFT's file format without transposes.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.experts.precision import low_rank, product_dtype

Gate = Callable[[], torch.Tensor | None]


def is_gpt2_conv1d(layer: nn.Module) -> bool:
    """Whether ``layer`` is GPT-2's ``Conv1D`` (a linear layer with its weight transposed). A model of
    transformers has imported it; where nothing has (the small models), no layer is one, and the
    check leaves transformers unimported (seconds of a device worker's start-up)."""
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    return pytorch_utils is not None and isinstance(layer, pytorch_utils.Conv1D)


def linear_features(layer: nn.Module) -> tuple[int, int]:
    """Return ``(in_features, out_features)`` of a Linear, GPT-2 Conv1D or bnb layer."""
    if is_gpt2_conv1d(layer):
        fan_in, fan_out = layer.weight.shape
        return int(fan_in), int(fan_out)
    if hasattr(layer, "in_features") and hasattr(layer, "out_features"):
        return int(layer.in_features), int(layer.out_features)
    raise TypeError(f"cannot attach LoRA to {type(layer).__name__}: not a linear layer")


class LoRA(nn.Module):
    """The residual ``γ·B(A x)`` of one low-rank expert on one linear layer.

    It computes in the dtype of the layer it adapts (bf16 on a bf16 base, as
    ``torch.autocast`` would), while its parameters may stay in fp32: no fp32
    copy of the layer's input is made or kept for backward; generation runs
    its products in fp32 (:mod:`~ondevice_moe.experts.precision`).

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
        widest = max(in_features, out_features)  # a narrow head (384 → 2) may carry the body's rank
        if rank > widest:
            raise UserError(f"LoRA rank {rank} is wider than the {in_features} → {out_features} layer it adapts: "
                            f"its update can have rank {min(in_features, out_features)} at most, and its factors "
                            "would hold more numbers than the layer", f"use a rank of at most {widest}")
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
        hidden = low_rank(x, self.lora_A)
        return (nn.functional.linear(hidden, self.lora_B.to(hidden.dtype)) * self.scaling).to(x.dtype)

    def codes(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``w·γ·A x``, shape ``(…, r)``: the scaling and a per-token weight ``w`` (…, 1)
        applied where they cost least, on the rank-``r`` codes."""
        codes = low_rank(x, self.lora_A) * self.scaling
        return codes if weight is None else codes * weight.to(codes.dtype)

    def add_codes(self, out: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """``out + B·codes`` in one fused multiply-add."""
        return add_product(out, codes, self.lora_B)

    def add_to(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``out + w·γ·B(A x)``: the base layer's output ``out`` plus this (gated) residual.

        Equal to ``out + w * self(x)``, without the two passes over the full
        output that scaling and adding a separate residual would take."""
        return self.add_codes(out, self.codes(x, weight))


def gated(weight: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """``w·residual``, or the residual itself for an expert without a gate (always on)."""
    return residual if weight is None else weight.to(residual.dtype) * residual


def add_gated(out: torch.Tensor, x: torch.Tensor, experts: Sequence[tuple[LoRA, torch.Tensor | None]],
              fused: bool = False) -> torch.Tensor:
    """``out + Σ_e w_e·γ_e·B_e(A_e x)`` for gated LoRA experts on one layer, in one matrix product.

    The experts' rank-space codes side by side times their ``B``s side by side
    is one LoRA of rank ``Σ r_e``: the full-size output is passed over once,
    not once per expert (FLoRAL mixes C adaptors on every layer; Hermes and
    CoMiGS several experts per projection). ``fused`` computes the codes from
    one product too, with the experts' ``A``s stacked (:func:`stacked_codes`):
    two products per layer however many experts, equal to float rounding."""
    if len(experts) == 1:
        lora, weight = experts[0]
        return lora.add_to(out, x, weight)
    codes = stacked_codes(x, experts) if fused else torch.cat([lora.codes(x, weight) for lora, weight in experts],
                                                               dim=-1)
    return add_product(out, codes, torch.cat([lora.lora_B for lora, _ in experts], dim=1))


def scaled(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes · scales`` (float32 scalings, broadcast) as a Python float scaling multiplies: in float32,
    rounded once to the codes' dtype, so a stack of experts scales as each expert alone does."""
    if codes.dtype == torch.float32:
        return codes * scales
    return (codes.float() * scales).to(codes.dtype)


def stacked_codes(x: torch.Tensor, experts: Sequence[tuple[LoRA, torch.Tensor | None]]) -> torch.Tensor:
    """Every expert's ``w_e·γ_e·A_e x`` side by side, shape ``(…, Σ r_e)``, from one product with the
    experts' ``A``s stacked; the scaling, then the gate, multiply each expert's slice, as
    :meth:`LoRA.codes` does."""
    codes = low_rank(x, torch.cat([lora.lora_A for lora, _ in experts], dim=0))
    scales = torch.cat([torch.full((lora.rank,), lora.scaling, device=codes.device) for lora, _ in experts])
    codes = scaled(codes, scales)
    return gated_slices(codes, [(lora.rank, weight) for lora, weight in experts])


def gated_slices(codes: torch.Tensor, slices: Sequence[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
    """``codes`` (…, Σ width) with each consecutive slice of ``width`` units scaled by its gate (…, 1);
    a slice without a gate is left as it is."""
    if all(gate is None for _, gate in slices):
        return codes
    gates = torch.cat([(codes.new_ones(()) if gate is None else gate.to(codes.dtype)).expand(*codes.shape[:-1], width)
                       for width, gate in slices], dim=-1)
    return codes * gates


def add_product(out: torch.Tensor, codes: torch.Tensor, ups: torch.Tensor) -> torch.Tensor:
    """``out + codes · upsᵀ`` in one fused multiply-add (``ups``: (out width, code width)), in
    :func:`~ondevice_moe.experts.precision.product_dtype` of ``out``, returned in ``out``'s dtype."""
    dtype = product_dtype(out)
    flat = out.reshape(-1, out.shape[-1]).to(dtype)
    summed = torch.addmm(flat, codes.reshape(-1, codes.shape[-1]).to(dtype), ups.t().to(dtype))
    return summed.reshape(out.shape).to(out.dtype)


class LoRAAdaptedLinear(nn.Module):
    """A frozen linear layer plus its LoRA adapters, keyed by expert name.

    The key carries the role into parameter names, e.g.
    ``attn.c_attn.adapters.shared.lora_A`` or ``…adapters.private_0.lora_A``.
    ``gates`` maps a key to the router's per-token weight for that expert,
    shape ``(…, 1)``; adapters without a gate are always on.
    """

    fused = False  # the adapters' products stacked (:func:`add_gated`); set by ``training.fused_experts``

    def __init__(self, base: nn.Module, adapters: dict[str, LoRA], gates: dict[str, Gate] | None = None) -> None:
        super().__init__()
        self.base = base
        self.adapters = nn.ModuleDict(adapters)
        self.gates = dict(gates or {})

    def add(self, name: str, adapter: LoRA, gate: Gate | None = None) -> None:
        """Attach one more adapter (an expert of another role or router) to this layer."""
        self.adapters[name] = adapter
        if gate is not None:
            self.gates[name] = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        gated = [(adapter, self.gates[name]() if name in self.gates else None)
                 for name, adapter in self.adapters.items()]
        return add_gated(out, x, gated, self.fused) if gated else out
