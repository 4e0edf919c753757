"""Options of CoMiGS and its baselines, with the paper's defaults (CoMiGS App. B.1.2)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ondevice_moe.methods.base import MAX_RANK, MethodOptions

COMIGS_VARIANTS = ("1G1S", "2G", "2S", "1GXs")


class LoRASizes(BaseModel):
    """LoRA on every attention and MLP linear layer, rsLoRA scaling α/√r (eq. 5),
    top-k routing with a load-balancing loss (eq. 6–7). The recipe's
    ``experts:`` section sets these for every method of the family."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lora_rank: int = Field(8, ge=1, le=MAX_RANK)
    lora_alpha: float = Field(16.0, gt=0)
    top_k: int = Field(2, ge=1)
    balance_form: Literal["uniform", "generalist"] = "uniform"


class LoRABaselineOptions(MethodOptions, LoRASizes):
    """Options of the CoMiGS baselines: the LoRA sizes and a label."""


class MoEBaselineOptions(LoRABaselineOptions):
    """``alternate_on_train``: the ``-tr`` rows of CoMiGS Table 5 (III) — routers
    updated in alternation with the experts, every τ iterations for s steps, on
    freshly sampled *training* batches (the authors' ``-is_alter -alter_on_train``)
    instead of jointly with the experts (Table 5, II)."""

    alternate_on_train: bool = False


class FedAvgMoEOptions(MoEBaselineOptions):
    """``share_router``: also average the routers (``fedavg-moe-shared-router``).
    Off by default: the authors' FedAvg-MoE baseline (epfml/CoMiGS, ``-as experts``)
    averages the experts only and keeps each router on its device."""

    share_router: bool = False


class HeterogeneousRankOptions(LoRABaselineOptions):
    """``ranks``: each user's MLP LoRA rank (CoMiGS Table 1 matches them to a 1GXs
    run: ``full`` = 8 × the user's expert count, ``active`` = 16 for top-2)."""

    ranks: list[int] | None = None


class HetLoRAOptions(HeterogeneousRankOptions):
    """HetLoRA's rank self-pruning (Cho et al., 2024; the CoMiGS authors' ``--is_pruning``):
    ``pruning_lambda`` λ weighs the local penalty λ·‖A[⌊γr⌋:r]‖·‖B[:, ⌊γr⌋:r]‖ and
    ``pruning_strength`` γ sets where a prune cuts. λ = 0 (the default) turns pruning off;
    CoMiGS App. D uses γ = 0.99 and sweeps λ ∈ {5e-2, 5e-3, 5e-4}."""

    pruning_lambda: float = Field(0.0, ge=0)
    pruning_strength: float = Field(0.99, gt=0, lt=1)


class CoMiGSOptions(LoRABaselineOptions):
    """``variant``: ``1G1S`` (one generalist, one specialist), ``2G`` / ``2S``
    (Table 5 ablations), ``1GXs`` (one generalist and ``experts[i] − 1``
    specialists on user i, §3.2). ``router_data: train`` gives the ``-tr``
    ablation (routers on the training split). ``generalist`` / ``specialist``:
    the expert kind of each role (LoRA in the paper; ``adapter`` puts a
    bottleneck adapter of rank ``adapter_rank`` after the MLP instead)."""

    variant: Literal["1G1S", "2G", "2S", "1GXs"] = "1G1S"
    experts: list[int] | None = None
    router_data: Literal["valid", "train"] = "valid"
    generalist: Literal["lora", "adapter"] = "lora"
    specialist: Literal["lora", "adapter"] = "lora"
    adapter_rank: int = Field(16, ge=1, le=MAX_RANK)


class PCLOptions(LoRABaselineOptions):
    """When PCL devices mix their peers' models: at the start of rounds ``first_mix``,
    ``first_mix + every``, … (the authors' code: after 0-indexed epochs 4, 6, 8, …,
    i.e. ``first_mix: 6, every: 2``; runs of a few rounds set e.g. ``first_mix: 2, every: 1``)."""

    first_mix: int = Field(6, ge=2)
    every: int = Field(2, ge=1)
