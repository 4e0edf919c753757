"""Adaptors on every layer of a model (FLoRAL §3.2): each layer of a known type
gets, per expert, a :class:`LayerAdaptor` whose pieces depend on the layer —
a LoRA on a Linear, a ConvLoRA on a Conv2d, a bias adaptor where the layer has
a bias, a scale adaptor on a normalisation layer — and the layer becomes an
:class:`AdaptedLayer` that adds its experts' residuals, each scaled by the
expert's gate (FLoRAL: the client's mixture weight ``π_c``, eq. FML).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ondevice_moe.experts.bias import BiasAdaptor
from ondevice_moe.experts.conv_lora import ConvForm, ConvLoRA, relative_rank
from ondevice_moe.experts.lora import LoRA, linear_features
from ondevice_moe.experts.norm import NormAdaptor, is_norm

Gate = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class AdaptorKinds:
    """Which adaptors go where (FLoRAL §3.2, Table 5): ``lora`` on Linear layers, ``conv``
    (a ConvLoRA form, or ``None``) on Conv2d layers, ``bias`` on every layer with a bias,
    ``norm`` on normalisation layers; ``budget`` is the relative parameter budget ρ per
    adaptor that sets each low-rank adaptor's rank."""

    budget: float = 0.01
    lora: bool = True
    conv: ConvForm | None = "balanced-2d"
    bias: bool = True
    norm: bool = False
    min_rank: int = 1


class LayerAdaptor(nn.ModuleDict):
    """One expert's adaptors on one layer (``lora``, ``bias``, ``norm``), zero-effect at init."""

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        residual = torch.zeros((), dtype=out.dtype, device=out.device)
        for name, piece in self.items():
            residual = residual + (piece(x) if name == "lora" else piece(x, out))
        return residual


def layer_adaptor(layer: nn.Module, kinds: AdaptorKinds, generator: torch.Generator) -> LayerAdaptor | None:
    """The adaptors ``kinds`` put on ``layer``; ``None`` for a layer that takes none."""
    pieces: dict[str, nn.Module] = {}
    if isinstance(layer, nn.Linear | Conv1D) and kinds.lora:
        fan_in, fan_out = linear_features(layer)
        rank = relative_rank(kinds.budget, fan_in * fan_out, fan_in + fan_out, kinds.min_rank)
        # FLoRAL's adaptor is W + UVᵀ, unscaled: α = r with α/r scaling gives γ = 1.
        pieces["lora"] = LoRA(fan_in, fan_out, rank, float(rank), generator, rank_stabilised=False)
    elif isinstance(layer, nn.Conv2d) and kinds.conv is not None:
        pieces["lora"] = ConvLoRA(layer, kinds.budget, kinds.conv, generator, kinds.min_rank)
    elif is_norm(layer) and kinds.norm:
        pieces["norm"] = NormAdaptor(layer)
    bias = getattr(layer, "bias", None)
    if kinds.bias and isinstance(bias, torch.Tensor) and not is_norm(layer):
        pieces["bias"] = BiasAdaptor(bias.numel(), 1 if isinstance(layer, nn.Conv2d) else -1)
    return LayerAdaptor(pieces) if pieces else None


class AdaptedLayer(nn.Module):
    """A layer plus its experts' adaptors (keyed by expert name, so parameter names carry
    the role: ``…adapters.shared_0.lora.lora_A``), each residual scaled by its gate."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.adapters = nn.ModuleDict()
        self.gates: dict[str, Gate] = {}

    def add(self, name: str, adaptor: LayerAdaptor, gate: Gate) -> None:
        self.adapters[name] = adaptor
        self.gates[name] = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for name, adaptor in self.adapters.items():
            out = out + self.gates[name]().to(out.dtype) * adaptor(x, out)
        return out


__all__ = ["AdaptedLayer", "AdaptorKinds", "LayerAdaptor", "layer_adaptor"]
