"""Options of the spelled-out mixture: every knob of the expert system, visible.

Example (a CoMiGS-style device with an adapter generalist and a LoRA specialist)::

    - name: mixture
      label: adapterG-loraS
      experts: [{kind: adapter, role: shared}, {kind: lora, role: private}]
      router: token-topk
      routers_train: bilevel
      attention_lora: shared

or FLoRAL's adaptors on every layer with a private one beside the shared::

    - name: mixture
      experts: [{kind: layers, role: shared}, {kind: layers, role: private}]
      router: client-mixture
      mixing: every-layer
      routers_train: joint
      aggregation: mixture-weighted
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ondevice_moe.methods.base import MAX_RANK, MethodOptions


class ExpertEntry(BaseModel):
    """One routed expert of every block."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["lora", "adapter", "prefix", "layers"]
    role: Literal["shared", "private"] = "shared"


class MixtureOptions(MethodOptions):
    """``mixing``: ``mlp`` (CoMiGS's exact MLP mixture, router on the MLP input)
    or ``block`` (Hermes: router on the block input, each expert gated where it
    sits; needed for prefix experts and for BERT/RoBERTa). ``routers_train``:
    ``bilevel`` (CoMiGS Alg. 1, routers on ``router_data`` every τ iterations)
    or ``joint`` (with the experts). ``aggregation``: ``mean`` or
    ``inverse-frequency`` (Hermes eq. 11, with usage counts); ``upload:
    selected`` keeps experts no token chose at home (Hermes §4.3). ``mixing:
    every-layer`` puts ``layers`` experts (FLoRAL's adaptors, sized by ``budget``,
    ``conv_lora``, ``bias``, ``norm``) on every layer under the ``client-mixture``
    router, and ``aggregation: mixture-weighted`` averages expert c by ``π_c N``
    (FLoRAL Alg. 1); ``preconditioning`` is FLoRAL App. D."""

    experts: list[ExpertEntry] = Field(min_length=1)
    router: Literal["none", "uniform", "token-topk", "hermes", "sigmoid", "client-mixture"] = "token-topk"
    mixing: Literal["mlp", "block", "every-layer"] = "mlp"
    routers_train: Literal["joint", "bilevel"] = "bilevel"
    router_data: Literal["valid", "train"] = "valid"
    attention_lora: Literal["shared", "private"] | None = None
    lora_rank: int = Field(8, ge=1, le=MAX_RANK)
    lora_alpha: float = Field(16.0, gt=0)
    rank_stabilised: bool = True
    adapter_rank: int = Field(16, ge=1, le=MAX_RANK)
    prefix_length: int = Field(16, ge=1)
    top_k: int = Field(2, ge=1)
    balance_form: Literal["uniform", "generalist"] = "uniform"
    temperature: float = Field(0.1, gt=0)
    gamma: float = Field(0.5, ge=0, le=1)
    bias_rate: float = Field(0.05, ge=0)
    gradient_ema: float = Field(0.9, ge=0, lt=1)
    aggregation: Literal["mean", "inverse-frequency", "mixture-weighted"] = "mean"
    upload: Literal["all", "selected"] = "all"
    budget: float = Field(0.01, gt=0, le=1)
    conv_lora: Literal["balanced-2d", "channel", "none"] = "balanced-2d"
    bias: bool = True
    norm: bool = False
    preconditioning: bool = False
