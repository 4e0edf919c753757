"""Options of FLoRAL and its baselines (FLoRAL §3.2, §5, App. D and G).

The recipe's ``floral:`` section sets these for every method of the family;
an entry may override them (``{name: floral, budget: 0.1}``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ondevice_moe.methods.base import MethodOptions


class FLoRALSizes(BaseModel):
    """``clusters``: C experts per client (default: the task's ground-truth clusters);
    ``budget``: ρ, each low-rank adaptor's parameters relative to its layer's (§3.2: 1 % or
    10 %); ``conv_lora``: the ConvLoRA form on Conv2d layers (App. F.1: ``balanced-2d``,
    the paper's choice; ``channel``; ``none``); ``bias`` / ``norm``: bias and
    normalisation adaptors (§3.2, App. F.2; the authors' code turns norm adaptors off);
    ``preconditioning``: App. D's LoRA preconditioning, on in the paper's experiments;
    ``train_base``: train the base ``u`` with the adaptors and average it (Alg. 1 — the
    small models); ``false`` keeps a Hugging Face base frozen, as PEFT does;
    ``router_lr``: θ's own learning rate (the authors' configs: 0.1 beside weights at
    0.03 on the synthetic MLP and CIFAR); unset, θ trains at the weights' rate;
    ``head_rank``: the rank of each adaptor's LoRA on a Hugging Face classifier's head
    (pooler and classifier) in place of ρ's. Not in the paper, whose models have no frozen
    head: at ρ = 1 % a 384 × 5 classifier gets rank 1, and a label permutation of 5 classes
    needs rank 4 or more. ``rank_multiple``: each linear layer's LoRA at that multiple of ρ's rank
    (``fedavg-adaptor`` with ``rank_multiple: C`` holds as many LoRA parameters as FLoRAL's C
    adaptors); ``lora_scale``: γ of each LoRA residual ``γ·UVᵀx`` (the paper: 1). Under AdamW the
    step moves the function by about γ·lr, so a C = 1 control at γ = 1/C takes the steps of one of
    FLoRAL's C adaptors gated by π_c ≈ 1/C. Neither applies to ConvLoRA."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clusters: int | None = Field(None, ge=1)
    budget: float = Field(0.01, gt=0, le=1)
    conv_lora: Literal["balanced-2d", "channel", "none"] = "balanced-2d"
    bias: bool = True
    norm: bool = False
    preconditioning: bool = True
    train_base: bool = True
    router_lr: float | None = Field(None, gt=0)
    head_rank: int | None = Field(None, ge=1)
    rank_multiple: int = Field(1, ge=1)
    lora_scale: float = Field(1.0, gt=0)


class FLoRALOptions(FLoRALSizes, MethodOptions):
    """FLoRAL and Ensemble: ``optimal_routing`` fixes each client's π to its ground-truth
    cluster (the π* rows of Tables 1 and 3) instead of learning θ; ``router_noise``: the
    uniform noise ``U[0, router_noise)`` added to θ in each training pass, as the authors'
    code does (``router_noise_std: 1.0``); the paper's Alg. 1 has none (the default)."""

    optimal_routing: bool = False
    router_noise: float = Field(0.0, ge=0)


class LocalAdaptorOptions(FLoRALSizes, MethodOptions):
    """Local Adaptor: one private adaptor per client on a shared base."""


class FedAvgAdaptorOptions(FLoRALSizes, MethodOptions):
    """FedAvg of one shared adaptor on every layer, FLoRAL's layout with C = 1 and no router: the
    equal-parameter FedAvg beside FLoRAL (``rank_multiple: C``). ``preconditioning`` is off by
    default (plain FedAvg; App. D is FLoRAL's); ``clusters`` and ``router_lr`` are not read."""

    preconditioning: bool = False
