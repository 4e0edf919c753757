"""Flow and its FedAvgFT baseline as a layout, a procedure and a server rule.

* ``flow`` (Alg. 1): every Linear/Conv2d layer of a small model holds a global copy (shared)
  and a local copy (private), mixed per instance by the shared policy ψ (layout
  ``layer-copies``, router ``instance-policy``, eq. 2–3); on a Hugging Face model the copies
  are a global and a local LoRA expert per block and copies of the task head's layers, the
  base frozen; the round is Flow's three phases
  (:mod:`ondevice_moe.methods.flow.procedure`); the server averages the global layers and ψ
  weighted by |ζ_g| (Alg. 1 line 14: the device reports |ζ_g| as its example count).
* ``fedavgft`` (Tables 2–3, "FedAvg + Finetuning"): the same layout with fixed paths — the
  global layers train with FedAvg on ζ_g, the local copies are the global model fine-tuned
  on ζ_ℓ, and the personal model is the local path.
* ``ditto`` (Li et al., 2021, "Ditto: fair and robust federated learning through
  personalization", Alg. 1; Flow Tables 2–3's Ditto row): the same layout; the global layers
  train with FedAvg, the local copies are a personal model kept between rounds and trained on
  ``f_k(v) + (λ/2)‖v − w^t‖²``; the personalised model is the local path.
* ``apfl`` (Deng et al., 2020, "Adaptive personalized federated learning", Alg. 1; Flow
  Tables 2–3's APFL row): the same layout; the global layers train with FedAvg, the local
  copies ``v`` (kept between rounds) and a private α train on the loss of the interpolated
  model ``(1 − α)·w + α·v``, which is the personalised model.
* FedAvg is ``fed-ft`` (the global model alone).
"""

from __future__ import annotations

from ondevice_moe.layout import ExpertSizes, ExpertSpec, Layout, RouterSpec
from ondevice_moe.methods.base import Method, MethodContext, Sharing, same_for_all
from ondevice_moe.methods.flow.config import FlowOptions
from ondevice_moe.methods.flow.procedure import FlowProcedure
from ondevice_moe.server_rules.rules import ServerRule


def _method(name: str, options: FlowOptions, context: MethodContext, policy: str) -> Method:
    apfl = policy == "apfl"
    layout = Layout((ExpertSpec("layer-copy", "private"),), RouterSpec(
                    "instance-policy", policy_hidden=options.policy_hidden,
                    interpolation=options.interpolation if apfl else None), "layer-copies",
                    sizes=ExpertSizes(lora_rank=options.lora_rank, lora_alpha=options.lora_alpha,
                                      rank_stabilised=False))
    # The layout makes the routed copies trainable; a Hugging Face base stays frozen.
    # APFL's α sits with ψ and trains with the local copies; it is the device's own, and ψ (unused) stays home.
    routers = "bilevel" if policy == "learned" else "joint" if apfl else "none"
    procedure = FlowProcedure(routers=routers, gamma=options.gamma, local_epochs=options.local_epochs,
                              global_epochs=options.global_epochs, local_fraction=options.local_fraction,
                              policy=policy, global_step=options.global_step,
                              proximal_lambda=options.proximal_lambda, zeta_split=options.zeta_split,
                              evaluation=options.evaluation, baseline_budget=options.baseline_budget)
    return Method(name, same_for_all(context.num_users, layout), procedure, ServerRule("num_examples"),
                  Sharing(share_router=not apfl))


def flow(options: FlowOptions, context: MethodContext) -> Method:
    """Flow: global and local copies of every layer, routed per instance by ψ (Alg. 1)."""
    return _method("flow" if options.gamma else "flow-no-regulariser", options, context, "learned")


def fedavg_ft(options: FlowOptions, context: MethodContext) -> Method:
    """FedAvgFT: FedAvg of the global layers, and a local fine-tuned copy as the personal model."""
    return _method("fedavgft", options, context, "fixed-paths")


def apfl(options: FlowOptions, context: MethodContext) -> Method:
    """APFL (Deng et al., 2020, Alg. 1): FedAvg of the global layers, a personal model of its own
    kept on the device, and the personalised model their interpolation by a learned private α."""
    return _method("apfl", options, context, "apfl")


def ditto(options: FlowOptions, context: MethodContext) -> Method:
    """Ditto (Li et al., 2021, Alg. 1): FedAvg of the global layers, and a personal model of
    its own kept on the device, trained with a proximal pull ``λ`` to the global one."""
    return _method("ditto", options, context, "ditto")
