"""Hermes (Alg. 1): LoRA, adapter and prefix experts in every block under one
dual-view sparse router (eq. 4–8), trained jointly; each device uploads the
experts its tokens selected, with usage counts, and the server averages each
expert with inverse-frequency weights (eq. 10–11). Experts and task heads are
shared (the server broadcasts every expert to every client); routers stay home.
"""

from __future__ import annotations

from ondevice_moe.layout import ExpertSizes, ExpertSpec, Layout, RouterSpec
from ondevice_moe.methods.base import Method, MethodContext, Procedure, Sharing, same_for_all
from ondevice_moe.methods.hermes.config import HermesOptions, HermesSizes
from ondevice_moe.methods.hermes.rule import InverseFrequencyRule

HERMES_KINDS = ("lora", "adapter", "prefix")


def block_layout(options: HermesSizes, kinds: tuple[str, ...], router: RouterSpec) -> Layout:
    """Shared experts of ``kinds`` in every block, gated where they sit (Hermes eq. 9)."""
    return Layout(
        experts=tuple(ExpertSpec(kind, "shared") for kind in kinds),
        router=router,
        mixing="block",
        sizes=ExpertSizes(lora_rank=options.lora_rank, lora_alpha=options.lora_alpha, rank_stabilised=False,
                          adapter_rank=options.adapter_rank, prefix_length=options.prefix_length),
    )


def hermes_router(options: HermesSizes) -> RouterSpec:
    return RouterSpec("hermes", top_k=options.top_k, temperature=options.temperature, gamma=options.gamma,
                      bias_rate=options.bias_rate, gradient_ema=options.gradient_ema)


def hermes(options: HermesOptions, context: MethodContext) -> Method:
    """Hermes, optionally without one component (Table 2)."""
    router = hermes_router(options)
    alpha = options.aggregation_alpha
    if options.ablation == "w/o-A":
        # §4.3: "a naive choice is to set ω = 1, which reduces the scheme to FedAvg over the
        # selected clients": eq. (11) at α = 0, each expert averaged uniformly over its uploaders.
        alpha = 0.0
    elif options.ablation == "w/o-K":
        router = RouterSpec(**{**router.__dict__, "top_k": len(HERMES_KINDS)})
    elif options.ablation == "w/o-G":
        router = RouterSpec(**{**router.__dict__, "use_gradient": False})
    elif options.ablation == "w/o-F":
        router = RouterSpec(**{**router.__dict__, "use_feature": False})
    name = "hermes" + (f"-{options.ablation}" if options.ablation else "") + \
        (f"-k{options.top_k}" if options.top_k != HermesSizes().top_k else "")
    layout = block_layout(options, HERMES_KINDS, router)
    rule = InverseFrequencyRule(context.weighting, alpha=alpha, epsilon=options.aggregation_epsilon)
    return Method(name, same_for_all(context.num_users, layout), procedure=Procedure(routers="joint"),
                  server_rule=rule, sharing=Sharing(selected_only=True))
