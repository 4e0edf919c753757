"""CoMiGS (Alg. 1): generalists averaged by the server, specialists and routers local.

The layout is a token top-k router over the MLP experts (exact mixture,
:mod:`ondevice_moe.mixture`) plus a shared LoRA on every attention projection;
the procedure is bi-level — experts on the training split (eq. 3), routers on
the validation split every τ iterations for s steps (eq. 4); the server
averages the generalists and the attention LoRA (Alg. 1 line 498).
"""

from __future__ import annotations

from ondevice_moe.errors import UserError
from ondevice_moe.layout import ExpertSizes, ExpertSpec, Layout, RouterSpec
from ondevice_moe.methods.base import Method, MethodContext, Procedure
from ondevice_moe.methods.comigs.config import CoMiGSOptions, LoRASizes
from ondevice_moe.server_rules.rules import ServerRule


def lora_layout(options: LoRASizes, experts: tuple[ExpertSpec, ...], router: str, attention: str,
                adapter_rank: int = ExpertSizes.adapter_rank) -> Layout:
    """A CoMiGS-family layout: the given MLP experts under ``router``, attention LoRA of role ``attention``."""
    return Layout(
        experts=experts,
        router=RouterSpec(router, top_k=options.top_k, balance=options.balance_form),
        mixing="mlp",
        attention_lora=attention,
        sizes=ExpertSizes(lora_rank=options.lora_rank, lora_alpha=options.lora_alpha, adapter_rank=adapter_rank),
    )


def comigs(options: CoMiGSOptions, context: MethodContext) -> Method:
    """CoMiGS-1G1S / 2G / 2S / 1GXs (§3.1–3.2).

    2S is fully local, its attention LoRA private too: the authors' ``comigs_2s``
    runs never aggregate anything. 2G shares everything but the routers.
    """
    generalist, specialist = ExpertSpec(options.generalist, "shared"), ExpertSpec(options.specialist, "private")
    fixed = {"1G1S": (generalist, specialist), "2G": (generalist, generalist), "2S": (specialist, specialist)}
    if options.variant in fixed:
        attention = "private" if options.variant == "2S" else "shared"
        layouts = tuple(lora_layout(options, fixed[options.variant], "token-topk", attention, options.adapter_rank)
                        for _ in range(context.num_users))
    else:
        counts = options.experts
        if not counts or len(counts) != context.num_users or min(counts) < 1:
            raise UserError(
                f"comigs variant 1GXs needs `experts`: one count >= 1 per user ({context.num_users} users), "
                f"got {counts}",
                "set e.g. `experts: [2, 4, 4, 2]` in the method entry",
            )
        layouts = tuple(lora_layout(options, (generalist, *(specialist,) * (count - 1)), "token-topk", "shared",
                                    options.adapter_rank) for count in counts)
    suffix = "-tr" if options.router_data == "train" else ""
    kinds = "" if (options.generalist, options.specialist) == ("lora", "lora") else \
        f"-{options.generalist}G-{options.specialist}S"
    return Method(f"comigs-{options.variant}{kinds}{suffix}", layouts,
                  procedure=Procedure(routers="bilevel", router_data=options.router_data),
                  server_rule=ServerRule(context.weighting))
