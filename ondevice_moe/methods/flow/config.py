"""Options of Flow and FedAvgFT (Flow §3, §5, App. B).

The recipe's ``flow:`` section sets these for both methods; an entry may override them
(``{name: flow, gamma: 0}`` is the ablation without the regulariser, §5.2).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ondevice_moe.methods.base import MAX_RANK, MethodOptions


class FlowSizes(BaseModel):
    """``gamma``: γ, the weight of the regulariser ``−(γ/L) Σ_j log q_0^(j)`` of eq. 4;
    ``local_epochs`` / ``global_epochs``: K₁ epochs of the local copies on ζ_ℓ (eq. 1) and K₂
    epochs of the policy/global alternation on ζ_g (Alg. 1 lines 7–10); ``local_fraction``:
    the share of the device's training examples in ζ_ℓ (the paper splits them in halves);
    ``policy_hidden``: the width of each of ψ's base layers (§3, Fig. 1); ``lora_rank`` /
    ``lora_alpha``: the global and local LoRA experts of a Hugging Face model (the paper
    routes whole layers of small networks; γ = α/r, as PEFT's LoRA); ``proximal_lambda``:
    Ditto's λ (Li et al. 2021, eq. 2), the pull of the personal model to the global one;
    ``interpolation``: APFL's α at the start (Deng et al. 2020; learned from there); ``global_step``:
    ``personalised`` trains the global layers on ``CE(w_p)`` (eq. 5), ``global-path`` on the
    global model's own loss, as the authors' code does (``trainers/client_flow.py``);
    ``zeta_split``, ``evaluation``, ``baseline_budget``: the paper's protocol or the authors' code's
    (:class:`~ondevice_moe.methods.base.FlowProcedure`). The authors' code also trains with SGD at
    momentum 0.9 (``training.momentum``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gamma: float = Field(0.01, ge=0)
    local_epochs: int = Field(1, ge=1)
    global_epochs: int = Field(1, ge=1)
    local_fraction: float = Field(0.5, gt=0, lt=1)
    policy_hidden: int = Field(64, ge=1)
    lora_rank: int = Field(8, ge=1, le=MAX_RANK)
    lora_alpha: float = Field(16.0, gt=0)
    proximal_lambda: float = Field(0.1, ge=0)
    interpolation: float = Field(0.5, gt=0, lt=1)
    global_step: Literal["personalised", "global-path"] = "personalised"
    zeta_split: Literal["per-round", "fixed"] = "per-round"
    evaluation: Literal["as-trained", "adapted"] = "as-trained"
    baseline_budget: Literal["paper", "flow"] = "paper"


class FlowOptions(FlowSizes, MethodOptions):
    """Flow and FedAvgFT: the ``flow:`` section's values, overridable per entry."""
