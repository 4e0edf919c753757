"""Adaptors on every layer of a model (FLoRAL §3.2): each layer of a known type
gets, per expert, a :class:`LayerAdaptor` whose pieces depend on the layer —
a LoRA on a Linear, a ConvLoRA on a Conv2d, a bias adaptor where the layer has
a bias, a scale adaptor on a normalisation layer — and the layer becomes an
:class:`AdaptedLayer` that adds its experts' residuals, each scaled by the
expert's gate (FLoRAL: the client's mixture weight ``π_c``, eq. FML).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.experts.bias import BiasAdaptor
from ondevice_moe.experts.conv_lora import ConvForm, ConvLoRA, relative_rank
from ondevice_moe.experts.lora import Gate, LoRA, add_gated, gated, is_gpt2_conv1d, linear_features
from ondevice_moe.experts.norm import NormAdaptor, is_norm


@dataclass(frozen=True)
class AdaptorKinds:
    """Which adaptors go where (FLoRAL §3.2, Table 5): ``lora`` on Linear layers, ``conv``
    (a ConvLoRA form, or ``None``) on Conv2d layers, ``bias`` on every layer with a bias,
    ``norm`` on normalisation layers; ``budget`` is the relative parameter budget ρ per
    adaptor that sets each low-rank adaptor's rank; ``head_rank``, when set, is the rank of
    the LoRA on a Hugging Face model's task-head layers instead; ``rank_multiple`` multiplies the
    rank ρ gives each linear layer's LoRA (one adaptor holding the parameters of several);
    ``lora_scale``: γ of each linear layer's LoRA residual ``γ·BA x`` (1: FLoRAL's unscaled ``UVᵀ``)."""

    budget: float = 0.01
    lora: bool = True
    conv: ConvForm | None = "balanced-2d"
    bias: bool = True
    norm: bool = False
    min_rank: int = 1
    head_rank: int | None = None
    rank_multiple: int = 1
    lora_scale: float = 1.0


class LayerAdaptor(nn.ModuleDict):
    """One expert's adaptors on one layer (``lora``, ``bias``, ``norm``), zero-effect at init."""

    @property
    def low_rank(self) -> LoRA | None:
        """The expert's LoRA on a linear layer, which :class:`AdaptedLayer` mixes with the
        other experts' in rank space; ``None`` when the layer has none (or a ConvLoRA)."""
        piece = dict(self.items()).get("lora")  # nn.ModuleDict has no get()
        return piece if isinstance(piece, LoRA) else None

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """The residual of every piece but :attr:`low_rank`; ``None`` when there is no other piece."""
        residual = None
        for name, piece in self.items():
            if piece is not self.low_rank:
                term = piece(x) if name == "lora" else piece(x, out)
                residual = term if residual is None else residual + term
        return residual


def layer_adaptor(layer: nn.Module, kinds: AdaptorKinds, generator: torch.Generator,
                  rank: int | None = None) -> LayerAdaptor | None:
    """The adaptors ``kinds`` put on ``layer``; ``None`` for a layer that takes none. A linear
    layer's LoRA has rank ``rank`` when given, else the rank of the budget ρ (§3.2)."""
    pieces: dict[str, nn.Module] = {}
    if (isinstance(layer, nn.Linear) or is_gpt2_conv1d(layer)) and kinds.lora:
        fan_in, fan_out = linear_features(layer)
        rank = rank or kinds.rank_multiple * relative_rank(kinds.budget, fan_in * fan_out, fan_in + fan_out,
                                                           kinds.min_rank)
        # FLoRAL's adaptor is W + UVᵀ, unscaled: α = r with α/r scaling gives γ = 1 (α = γ·r in general).
        pieces["lora"] = LoRA(fan_in, fan_out, rank, kinds.lora_scale * rank, generator, rank_stabilised=False)
    elif isinstance(layer, nn.Conv2d) and kinds.conv is not None:
        if kinds.rank_multiple != 1 or kinds.lora_scale != 1.0:
            raise UserError("rank_multiple and lora_scale size the LoRA of linear layers; this model has "
                            "convolutions, whose ConvLoRA takes neither",
                            "drop rank_multiple and lora_scale, or raise `budget` instead")
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

    fused = False  # the LoRAs' products stacked (:func:`add_gated`); set by ``training.fused_experts``

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.adapters = nn.ModuleDict()
        self.gates: dict[str, Gate] = {}

    def add(self, name: str, adaptor: LayerAdaptor, gate: Gate) -> None:
        self.adapters[name] = adaptor
        self.gates[name] = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base(x)
        gates = {name: self.gates[name]() for name in self.adapters}
        low_rank = [(adaptor.low_rank, gates[name]) for name, adaptor in self.adapters.items()
                    if adaptor.low_rank is not None]
        out = add_gated(base, x, low_rank, self.fused) if low_rank else base
        for name, adaptor in self.adapters.items():
            residual = adaptor(x, base)
            if residual is not None:
                out = out + gated(gates[name], residual)
        return out


__all__ = ["AdaptedLayer", "AdaptorKinds", "LayerAdaptor", "layer_adaptor"]
