"""The baselines of Hermes Tables 1–2 (§5.1): FedAvg of full fine-tuning, of one
PEFT kind, or of all three kinds under FedUniPELT's dense sigmoid gates
(Mao et al., 2022; no top-k, no balancing, everything uploaded)."""

from __future__ import annotations

from collections.abc import Callable

from ondevice_moe.layout import RouterSpec
from ondevice_moe.methods.base import Method, MethodContext, Procedure, same_for_all
from ondevice_moe.methods.hermes.config import HermesSizes
from ondevice_moe.methods.hermes.method import HERMES_KINDS, block_layout
from ondevice_moe.server_rules.rules import ServerRule


def fed_ft(options: HermesSizes, context: MethodContext) -> Method:
    """FedAvg of full fine-tuning."""
    return Method("fed-ft", same_for_all(context.num_users, None), procedure=Procedure(full_finetune=True),
                  server_rule=ServerRule(context.weighting))


def single_kind(kind: str) -> Callable[[HermesSizes, MethodContext], Method]:
    """FedAvg of one PEFT kind, always on."""

    def build(options: HermesSizes, context: MethodContext) -> Method:
        layout = block_layout(options, (kind,), RouterSpec("none"))
        return Method(f"fed-{kind}", same_for_all(context.num_users, layout),
                      server_rule=ServerRule(context.weighting))

    build.__doc__ = f"FedAvg of {kind} experts alone."
    return build


def fed_unipelt(options: HermesSizes, context: MethodContext) -> Method:
    """Federated UniPELT: all three kinds, dense sigmoid gates, everything uploaded."""
    layout = block_layout(options, HERMES_KINDS, RouterSpec("sigmoid"))
    return Method("fed-unipelt", same_for_all(context.num_users, layout), procedure=Procedure(routers="joint"),
                  server_rule=ServerRule(context.weighting))
