"""Hermes and the baselines of its Tables 1–2 (Hermes §5.1).

* ``hermes``: LoRA + Adapter + Prefix experts in every block, dual-view top-k
  router, selected experts uploaded with usage counts, inverse-frequency
  aggregation. ``ablation`` removes one component: ``w/o-A`` (plain average),
  ``w/o-K`` (no top-k: all experts, dense softmax), ``w/o-G`` (no gradient
  view), ``w/o-F`` (no feature view); ``top_k`` varies k (Fig. 3a).
* ``fed-ft``: FedAvg of full fine-tuning; ``fed-lora`` / ``fed-adapter`` /
  ``fed-prefix``: FedAvg of one PEFT kind; ``fed-unipelt``: all three kinds with
  dense sigmoid gates (UniPELT), no top-k, no balancing, everything uploaded.

Experts and task heads are shared (the server broadcasts every expert to every
client); routers stay on the device.
"""

from __future__ import annotations

from dataclasses import replace

from ondevice_moe.block_experts import EXPERT_KINDS, BlockLayout
from ondevice_moe.errors import UserError
from ondevice_moe.methods.base import Method

HERMES_ABLATIONS = ("w/o-A", "w/o-K", "w/o-G", "w/o-F")


def _same_for_all(num_users: int, layout: BlockLayout | None) -> tuple[BlockLayout | None, ...]:
    return tuple(layout for _ in range(num_users))


def hermes(base: BlockLayout, num_users: int, ablation: str | None = None, top_k: int | None = None,
           **_: object) -> Method:
    """Hermes (Alg. 1), optionally without one component (Table 2) or with another k (Fig. 3a)."""
    layout = replace(base, experts=EXPERT_KINDS, router="hermes", top_k=top_k or base.top_k)
    aggregation = "inverse_frequency"
    if ablation == "w/o-A":
        aggregation = "mean"
    elif ablation == "w/o-K":
        layout = replace(layout, top_k=len(EXPERT_KINDS))
    elif ablation == "w/o-G":
        layout = replace(layout, use_gradient=False)
    elif ablation == "w/o-F":
        layout = replace(layout, use_feature=False)
    elif ablation is not None:
        raise UserError(f"unknown hermes ablation '{ablation}'", f"use one of {list(HERMES_ABLATIONS)}")
    name = "hermes" + (f"-{ablation}" if ablation else "") + (f"-k{top_k}" if top_k else "")
    return Method(name, _same_for_all(num_users, layout), router_update="joint", upload_selected_only=True,
                  aggregation=aggregation)


def fed_ft(base: BlockLayout, num_users: int, **_: object) -> Method:
    """FedAvg of full fine-tuning."""
    return Method("fed-ft", _same_for_all(num_users, None), full_finetune=True)


def _single_kind(kind: str):
    def build(base: BlockLayout, num_users: int, **_: object) -> Method:
        return Method(f"fed-{kind}", _same_for_all(num_users, replace(base, experts=(kind,), router="none")))

    build.__doc__ = f"FedAvg of {kind} experts alone."
    return build


def fed_unipelt(base: BlockLayout, num_users: int, **_: object) -> Method:
    """Federated UniPELT: all three kinds, dense sigmoid gates, everything uploaded."""
    layout = replace(base, experts=EXPERT_KINDS, router="sigmoid")
    return Method("fed-unipelt", _same_for_all(num_users, layout), router_update="joint")


CLASSIFICATION_METHODS = {
    "hermes": hermes,
    "fed-ft": fed_ft,
    "fed-lora": _single_kind("lora"),
    "fed-adapter": _single_kind("adapter"),
    "fed-prefix": _single_kind("prefix"),
    "fed-unipelt": fed_unipelt,
}
