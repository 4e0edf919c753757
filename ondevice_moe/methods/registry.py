"""The methods of the CoMiGS paper (§3.1, Table 2 and Table 5), in one harness.

Every trained baseline holds two LoRA modules in each MLP, matching the
trainable parameter count of CoMiGS-1G1S as the paper does; methods without
routing mix them with fixed equal weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ondevice_moe.block_experts import BlockLayout
from ondevice_moe.errors import UserError
from ondevice_moe.inject import ExpertLayout
from ondevice_moe.methods.base import Method
from ondevice_moe.methods.hermes import CLASSIFICATION_METHODS

COMIGS_VARIANTS = ("1G1S", "2G", "2S", "1GXs")


def _layout(base: ExpertLayout, attention: str, experts: tuple[str, ...], router: str) -> ExpertLayout:
    return replace(base, attention_roles=(attention,), mlp_experts=experts, router=router)


def _same_for_all(num_users: int, layout: ExpertLayout | None) -> tuple[ExpertLayout | None, ...]:
    return tuple(layout for _ in range(num_users))


def pretrained(base: ExpertLayout, num_users: int, **_: object) -> Method:
    """Lower bound: the frozen base model, no training."""
    return Method("pretrained", _same_for_all(num_users, None))


def local(base: ExpertLayout, num_users: int, **_: object) -> Method:
    """Each user trains two private LoRA modules alone."""
    return Method("local", _same_for_all(num_users, _layout(base, "private", ("private_0", "private_1"), "uniform")))


def fedavg(base: ExpertLayout, num_users: int, **_: object) -> Method:
    """FedAvg (McMahan et al., 2017) of two LoRA modules."""
    return Method("fedavg", _same_for_all(num_users, _layout(base, "shared", ("shared_0", "shared_1"), "uniform")))


def local_moe(base: ExpertLayout, num_users: int, **_: object) -> Method:
    """Two private experts and a router trained jointly on the training loss (Table 5, II)."""
    layout = _layout(base, "private", ("private_0", "private_1"), "topk")
    return Method("local-moe", _same_for_all(num_users, layout), router_update="joint")


def fedavg_moe(base: ExpertLayout, num_users: int, **_: object) -> Method:
    """FedAvg of a whole two-expert MoE, router included (Table 5, II)."""
    layout = _layout(base, "shared", ("shared_0", "shared_1"), "topk")
    return Method("fedavg-moe", _same_for_all(num_users, layout), router_update="joint", share_router=True)


def ffa_lora(base: ExpertLayout, num_users: int, **_: object) -> Method:
    """FFA-LoRA (Sun et al., 2024): A frozen at its shared random init, B averaged."""
    method = fedavg(base, num_users)
    return replace(method, name="ffa-lora", frozen_matrices=frozenset({"lora_A"}))


def fedsa_lora(base: ExpertLayout, num_users: int, **_: object) -> Method:
    """FedSA-LoRA (Guo et al., 2024): A averaged, B kept on the device."""
    method = fedavg(base, num_users)
    return replace(method, name="fedsa-lora", private_matrices=frozenset({"lora_B"}))


def centralized(base: ExpertLayout, num_users: int, **_: object) -> Method:
    """Upper bound: one model trained on the pooled training data of all users."""
    method = fedavg(base, 1)
    return replace(method, name="centralized", centralized=True)


def comigs(
    base: ExpertLayout,
    num_users: int,
    variant: str = "1G1S",
    experts: list[int] | None = None,
    router_data: str = "valid",
    **_: object,
) -> Method:
    """CoMiGS (Alg. 1): generalists averaged by the server, specialists and routers local.

    ``1G1S``: one generalist and one specialist; ``2G``/``2S``: two generalists /
    two specialists (ablations); ``1GXs``: one generalist and ``experts[i] - 1``
    specialists on user ``i`` (§3.2). Attention LoRA is shared in every variant.
    """
    fixed = {"1G1S": ("shared_0", "private_0"), "2G": ("shared_0", "shared_1"), "2S": ("private_0", "private_1")}
    if variant in fixed:
        layouts = _same_for_all(num_users, _layout(base, "shared", fixed[variant], "topk"))
    elif variant == "1GXs":
        if not experts or len(experts) != num_users or min(experts) < 1:
            raise UserError(
                f"comigs variant 1GXs needs `experts`: one count >= 1 per user ({num_users} users), got {experts}",
                "set e.g. `experts: [2, 4, 4, 2]` in the method entry",
            )
        layouts = tuple(
            _layout(base, "shared", ("shared_0", *(f"private_{j}" for j in range(count - 1))), "topk")
            for count in experts
        )
    else:
        raise UserError(f"unknown comigs variant '{variant}'", f"use one of {list(COMIGS_VARIANTS)}")
    suffix = "-tr" if router_data == "train" else ""
    return Method(f"comigs-{variant}{suffix}", layouts, router_update="bilevel", router_data=router_data)


LM_METHODS: dict[str, Callable[..., Method]] = {
    "pretrained": pretrained,
    "local": local,
    "fedavg": fedavg,
    "local-moe": local_moe,
    "fedavg-moe": fedavg_moe,
    "ffa-lora": ffa_lora,
    "fedsa-lora": fedsa_lora,
    "centralized": centralized,
    "comigs": comigs,
}


METHODS: dict[str, Callable[..., Method]] = {**LM_METHODS, **CLASSIFICATION_METHODS}


def build_method(name: str, base: ExpertLayout | BlockLayout, num_users: int, **options: object) -> Method:
    """Resolve a recipe's method entry for ``num_users`` users.

    ``base`` carries the recipe's expert hyper-parameters: an
    :class:`ExpertLayout` for language-modelling methods, a
    :class:`BlockLayout` for classification methods.
    """
    if name not in METHODS:
        raise UserError(f"unknown method '{name}'", f"use one of {sorted(METHODS)}")
    return METHODS[name](base, num_users, **options)
