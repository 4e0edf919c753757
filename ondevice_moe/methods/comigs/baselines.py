"""The baselines of CoMiGS Table 2 and Table 5 (II).

Every trained baseline holds two LoRA modules in each MLP, matching the
trainable parameter count of CoMiGS-1G1S as the paper does; methods without
routing mix them with fixed equal weights. The one exception is ``fedavg``, FedAvg
as PEFT users know it: one LoRA of twice the rank per MLP linear (the same
parameters); the paper's two-module FedAvg is ``fedavg-two-lora``.
"""

from __future__ import annotations

from dataclasses import replace

from ondevice_moe.errors import UserError
from ondevice_moe.layout import ExpertSpec, lora_experts
from ondevice_moe.methods.base import Method, MethodContext, Procedure, Sharing, same_for_all
from ondevice_moe.methods.comigs.config import (
    FedAvgMoEOptions,
    HeterogeneousRankOptions,
    HetLoRAOptions,
    LoRASizes,
    MoEBaselineOptions,
    PCLOptions,
)
from ondevice_moe.methods.comigs.method import lora_layout
from ondevice_moe.methods.comigs.procedures import ExpertsInTurn, PeerMixing, RankSelfPruning
from ondevice_moe.server_rules.low_rank_rules import FlexLoRARule, HetLoRARule
from ondevice_moe.server_rules.peers import PeerRelayRule
from ondevice_moe.server_rules.rules import ServerRule

PRIVATE_PAIR = lora_experts(("private", "private"))
SHARED_PAIR = lora_experts(("shared", "shared"))


def pretrained(options: LoRASizes, context: MethodContext) -> Method:
    """Lower bound: the frozen base model, no training."""
    return Method("pretrained", same_for_all(context.num_users, None))


def local(options: LoRASizes, context: MethodContext) -> Method:
    """Each user trains two private LoRA modules alone."""
    layout = lora_layout(options, PRIVATE_PAIR, "uniform", "private")
    return Method("local", same_for_all(context.num_users, layout))


def fedavg(options: LoRASizes, context: MethodContext) -> Method:
    """FedAvg (McMahan et al., 2017) as PEFT users know it: one shared LoRA on each targeted module
    (rank 2r on each MLP linear, rank r on attention), averaged each round — the FlowerTune baseline.
    The same trainable parameters as CoMiGS-1G1S and as :func:`fedavg_two_lora`; the trained model
    *is* one PEFT adapter, so its export reproduces its figures exactly."""
    layout = lora_layout(options, (ExpertSpec("lora", "shared", rank=2 * options.lora_rank),), "uniform", "shared")
    return Method("fedavg", same_for_all(context.num_users, layout), server_rule=ServerRule(context.weighting))


def fedavg_two_lora(options: LoRASizes, context: MethodContext) -> Method:
    """FedAvg of two LoRA modules per MLP at fixed weights ½ (CoMiGS Table 2's FedAvg, matching the
    parameters of its two experts), and the base of FFA-LoRA, FedSA-LoRA and the centralized bound.
    Each module's MLP runs the nonlinearity between its own LoRAs, so it exports merged at ½, which
    approximates the trained model (docs/export.md measures the gap)."""
    layout = lora_layout(options, SHARED_PAIR, "uniform", "shared")
    return Method("fedavg-two-lora", same_for_all(context.num_users, layout), server_rule=ServerRule(context.weighting))


def _moe_procedure(options: MoEBaselineOptions) -> Procedure:
    """Joint router updates (Table 5, II), or alternating ones on training batches (III, ``-tr``)."""
    return Procedure(routers="bilevel", router_data="train") if options.alternate_on_train else \
        Procedure(routers="joint")


def local_moe(options: MoEBaselineOptions, context: MethodContext) -> Method:
    """Two private experts and a router on the training loss (Table 5, II; III with ``-tr``)."""
    layout = lora_layout(options, PRIVATE_PAIR, "token-topk", "private")
    name = "local-moe-tr" if options.alternate_on_train else "local-moe"
    return Method(name, same_for_all(context.num_users, layout), procedure=_moe_procedure(options))


def fedavg_moe(options: FedAvgMoEOptions, context: MethodContext) -> Method:
    """FedAvg of a two-expert MoE (Table 5, II; III with ``-tr``): the experts are
    averaged, each router stays on its device (as in the authors' baseline), or
    is averaged too with ``share_router``."""
    layout = lora_layout(options, SHARED_PAIR, "token-topk", "shared")
    name = "fedavg-moe" + ("-shared-router" if options.share_router else "") + \
        ("-tr" if options.alternate_on_train else "")
    return Method(name, same_for_all(context.num_users, layout), procedure=_moe_procedure(options),
                  server_rule=ServerRule(context.weighting), sharing=Sharing(share_router=options.share_router))


def pfedmoe(options: LoRASizes, context: MethodContext) -> Method:
    """pFedMoE (Yi et al., 2024) as the CoMiGS authors run it (``pFedMoE.sh``, CoMiGS
    Table 2): CoMiGS-1G1S's layout (a shared and a private LoRA expert under a local
    router, shared attention LoRA), with the router trained jointly with the experts on
    the training loss instead of bi-level on a validation split."""
    layout = lora_layout(options, lora_experts(("shared", "private")), "token-topk", "shared")
    return Method("pfedmoe", same_for_all(context.num_users, layout), procedure=Procedure(routers="joint"),
                  server_rule=ServerRule(context.weighting))


def pcl(options: PCLOptions, context: MethodContext) -> Method:
    """PCL (Wagner et al., 2024; CoMiGS Table 2): each user's two LoRA modules (as Local),
    replaced now and then by the average of all users' modules weighted by trust,
    softmax(−perplexity) on the user's validation split (:mod:`ondevice_moe.server_rules.peers`)."""
    layout = lora_layout(options, SHARED_PAIR, "uniform", "shared")
    return Method("pcl", same_for_all(context.num_users, layout), procedure=PeerMixing(),
                  server_rule=PeerRelayRule(first_mix=options.first_mix, every=options.every),
                  sharing=Sharing(devices_keep_models=True))


def fdlora(options: LoRASizes, context: MethodContext) -> Method:
    """FDLoRA (Qi et al., 2024; CoMiGS Table 2): a global LoRA module in each MLP, averaged
    by the server, and a personal one that stays home, each trained alone in turn; before
    testing, each device weighs the two on its validation split (:mod:`ondevice_moe.routing.fusion`).
    The attention LoRA is shared, as in CoMiGS-1G1S, so that the two methods differ in how
    they weigh the same experts: per token by a learned router, or once per device."""
    layout = lora_layout(options, lora_experts(("shared", "private")), "client", "shared")
    return Method("fdlora", same_for_all(context.num_users, layout), procedure=ExpertsInTurn(),
                  server_rule=ServerRule(context.weighting))


def ffa_lora(options: LoRASizes, context: MethodContext) -> Method:
    """FFA-LoRA (Sun et al., 2024): A frozen at its shared random init, B averaged."""
    return replace(fedavg_two_lora(options, context), name="ffa-lora",
                   sharing=Sharing(frozen_matrices=frozenset({"lora_A"})))


def fedsa_lora(options: LoRASizes, context: MethodContext) -> Method:
    """FedSA-LoRA (Guo et al., 2024): A averaged, B kept on the device."""
    return replace(fedavg_two_lora(options, context), name="fedsa-lora",
                   sharing=Sharing(private_matrices=frozenset({"lora_B"})))


def centralized(options: LoRASizes, context: MethodContext) -> Method:
    """Upper bound: one model trained on the pooled training data of all users."""
    method = fedavg_two_lora(options, replace(context, num_users=1))
    return replace(method, name="centralized", centralized=True)


def _ranked_layouts(options: HeterogeneousRankOptions, context: MethodContext, name: str) -> tuple:
    """One shared MLP LoRA per device at that device's rank, beside the shared attention LoRA."""
    ranks = options.ranks
    if not ranks or len(ranks) != context.num_users or min(ranks) < 1:
        raise UserError(f"{name} needs `ranks`: one MLP LoRA rank >= 1 per user ({context.num_users} users), "
                        f"got {ranks}", f"set e.g. `ranks: [32, 16, 16, 16]` in the {name} entry")
    return tuple(lora_layout(options, (ExpertSpec("lora", "shared", rank=rank),), "uniform", "shared")
                 for rank in ranks)


def hetlora(options: HetLoRAOptions, context: MethodContext) -> Method:
    """HetLoRA (Cho et al., 2024; CoMiGS Table 1): heterogeneous ranks, zero-padded
    sparsity-weighted aggregation, truncation to each device's rank, and, with
    ``pruning_lambda`` > 0, rank self-pruning (:mod:`ondevice_moe.server_rules.rank_pruning`)."""
    layouts = _ranked_layouts(options, context, "hetlora")
    pruning = options.pruning_lambda > 0
    rule = HetLoRARule(context.weighting, ranks=tuple(options.ranks),
                       pruning_strength=options.pruning_strength if pruning else None)
    procedure = RankSelfPruning(pruning_lambda=options.pruning_lambda, pruning_strength=options.pruning_strength)
    return Method("hetlora", layouts, procedure=procedure, server_rule=rule)


def flexlora(options: HeterogeneousRankOptions, context: MethodContext) -> Method:
    """FlexLoRA (Bai et al., 2024; CoMiGS Table 1): the full updates averaged by example
    counts, redistributed to each device's rank by truncated SVD."""
    layouts = _ranked_layouts(options, context, "flexlora")
    rule = FlexLoRARule(context.weighting, ranks=tuple(options.ranks), lora_alpha=options.lora_alpha,
                        rank_stabilised=layouts[0].sizes.rank_stabilised)
    return Method("flexlora", layouts, server_rule=rule)
