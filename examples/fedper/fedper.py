"""FedPer (Arivazhagan et al., 2019, §3), a method of ondevice-moe as a plug-in file.

Each device trains its whole small model; the base layers travel and are averaged as FedAvg averages
them, the personalisation layers (here: the task head, the model's output layer) never leave the
device. A recipe runs it with ``plugins: [fedper.py]`` and ``methods: [fedper]`` (``--trust-plugins``).
"""

from ondevice_moe.methods.base import HEAD, Method, MethodContext, MethodOptions, Procedure, Sharing, same_for_all
from ondevice_moe.methods.spec import SMALL, MethodSpec
from ondevice_moe.server_rules.rules import ServerRule


class FedPerOptions(MethodOptions):
    """FedPer takes no options: its base and its head are the recipe's model's."""


def fedper(options: FedPerOptions, context: MethodContext) -> Method:
    """The whole model trains; everything but the head is shared (FedPer eq. 1–2's base layers W_B)."""
    return Method("fedper", same_for_all(context.num_users, None), procedure=Procedure(full_finetune=True),
                  server_rule=ServerRule(context.weighting), sharing=Sharing(private_modules=(HEAD,)))


METHODS = {"fedper": MethodSpec(FedPerOptions, fedper, frozenset({SMALL}))}
