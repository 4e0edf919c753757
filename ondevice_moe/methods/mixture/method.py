"""Build the spelled-out mixture: the layout, procedure and server rule its options name."""

from __future__ import annotations

from ondevice_moe.experts.layer import AdaptorKinds
from ondevice_moe.layout import ExpertSizes, ExpertSpec, Layout, RouterSpec
from ondevice_moe.methods.base import Method, MethodContext, Sharing, same_for_all
from ondevice_moe.methods.floral.procedure import AdaptorProcedure
from ondevice_moe.methods.floral.rule import MixtureRule
from ondevice_moe.methods.hermes.rule import InverseFrequencyRule
from ondevice_moe.methods.mixture.config import MixtureOptions
from ondevice_moe.server_rules.rules import ServerRule


def mixture(options: MixtureOptions, context: MethodContext) -> Method:
    """Any expert kinds and roles under any router, on every device alike."""
    layout = Layout(
        experts=tuple(ExpertSpec(e.kind, e.role) for e in options.experts),
        router=RouterSpec(options.router, top_k=options.top_k, balance=options.balance_form,
                          temperature=options.temperature, gamma=options.gamma, bias_rate=options.bias_rate,
                          gradient_ema=options.gradient_ema),
        mixing=options.mixing,
        attention_lora=options.attention_lora,
        sizes=ExpertSizes(options.lora_rank, options.lora_alpha, options.rank_stabilised, options.adapter_rank,
                          options.prefix_length),
        adaptor_kinds=AdaptorKinds(options.budget, conv=None if options.conv_lora == "none" else options.conv_lora,
                                   bias=options.bias, norm=options.norm),
    )
    learned = options.router in ("token-topk", "hermes", "sigmoid", "client-mixture")
    procedure = AdaptorProcedure(routers=options.routers_train if learned else "none",
                                 router_data=options.router_data, lora_preconditioning=options.preconditioning)
    rules = {"inverse-frequency": InverseFrequencyRule(context.weighting),
             "mixture-weighted": MixtureRule(context.weighting),
             "mean": ServerRule(context.weighting, partial_uploads=options.upload == "selected")}
    rule = rules[options.aggregation]
    name = "mixture-" + "+".join(f"{e.kind}:{e.role}" for e in options.experts)
    return Method(name, same_for_all(context.num_users, layout), procedure=procedure, server_rule=rule,
                  sharing=Sharing(selected_only=options.upload == "selected"))
