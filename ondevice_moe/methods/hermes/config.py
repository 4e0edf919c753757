"""Options of Hermes and its baselines, with the paper's defaults (Hermes §5.1).

The recipe's ``hermes:`` section sets these for every method of the family.
γ (the weight of the feature view, eq. 7) is not given in the paper; 0.5
weighs both views equally.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ondevice_moe.methods.base import MAX_RANK, MethodOptions

HERMES_ABLATIONS = ("w/o-A", "w/o-K", "w/o-G", "w/o-F")


class HermesSizes(BaseModel):
    """LoRA r = 8 (α/r scaling) on query and value, adapter r = 16, prefix l_p = 16;
    top-2 sparse softmax at τ = 0.1; loss-free bias rate γ_b = 0.05; inverse-frequency
    aggregation ω = (h + ε)^(−α) with α = 1/2, ε = 1 (eq. 11)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lora_rank: int = Field(8, ge=1, le=MAX_RANK)
    lora_alpha: float = Field(16.0, gt=0)
    adapter_rank: int = Field(16, ge=1, le=MAX_RANK)
    prefix_length: int = Field(16, ge=1)
    top_k: int = Field(2, ge=1)
    temperature: float = Field(0.1, gt=0)
    gamma: float = Field(0.5, ge=0, le=1)
    bias_rate: float = Field(0.05, ge=0)
    gradient_ema: float = Field(0.9, ge=0, lt=1)
    aggregation_alpha: float = Field(0.5, ge=0)
    aggregation_epsilon: float = Field(1.0, gt=0)


class HermesBaselineOptions(MethodOptions, HermesSizes):
    """Options of the Hermes baselines: the expert sizes and a label."""


class HermesOptions(HermesBaselineOptions):
    """``ablation`` removes one component (Table 2): ``w/o-A`` each expert averaged
    uniformly over the devices that uploaded it (§4.3's ω = 1; task heads keep ``weighting``),
    ``w/o-K`` no top-k (all experts, dense softmax), ``w/o-G`` no gradient view,
    ``w/o-F`` no feature view."""

    ablation: Literal["w/o-A", "w/o-K", "w/o-G", "w/o-F"] | None = None
