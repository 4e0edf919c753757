"""What a layout is: its routed experts (kind, role), its router and its mixing (:mod:`ondevice_moe.layout`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ondevice_moe.errors import UserError
from ondevice_moe.experts.layer import AdaptorKinds
from ondevice_moe.routing.routers import BalanceForm

ExpertKind = Literal["lora", "adapter", "prefix", "layers", "model", "layer-copy"]
RoleName = Literal["shared", "private"]
RouterKind = Literal["none", "uniform", "token-topk", "hermes", "sigmoid", "client", "client-mixture",
                     "instance-policy"]
Mixing = Literal["mlp", "block", "every-layer", "ensemble", "layer-copies"]

EXPERT_KINDS: tuple[str, ...] = ("lora", "adapter", "prefix", "layers", "model", "layer-copy")
ROUTER_KINDS: tuple[str, ...] = ("none", "uniform", "token-topk", "hermes", "sigmoid", "client", "client-mixture",
                                 "instance-policy")
CLIENT_LEVEL_KINDS = {"every-layer": "layers", "ensemble": "model"}


@dataclass(frozen=True)
class ExpertSpec:
    """One routed expert: its kind, its role and, for a LoRA expert, its own rank
    (default: the layout's ``sizes.lora_rank``; HetLoRA and FlexLoRA give devices
    different ranks)."""

    kind: ExpertKind
    role: RoleName
    rank: int | None = None


@dataclass(frozen=True)
class RouterSpec:
    """How a site's experts mix.

    ``none``: every expert always on at weight 1 (single-PEFT baselines);
    ``uniform``: fixed equal weights; ``token-topk``: CoMiGS's linear gate,
    softmax, top-k renormalised, with a balance loss (``balance`` form, eq. 6–7);
    ``hermes``: the dual-view router of Hermes eq. (4)–(8) (``use_feature`` /
    ``use_gradient`` switch views off for the ablations); ``sigmoid``:
    FedUniPELT's dense sigmoid gates; ``client``: one weight per expert for the
    whole device, set by the method (FDLoRA); ``client-mixture``: FLoRAL's learned
    ``π = softmax(θ)`` for the whole device, or the one-hot ``π*`` on expert ``optimal``;
    ``instance-policy``: Flow's ψ (eq. 2), ``policy_hidden`` units per base layer, and with
    ``interpolation`` APFL's private α starting there; ``noise``: the uniform noise a
    ``client-mixture`` router adds to θ in training (the FLoRAL authors' code; 0 is Alg. 1).
    """

    kind: RouterKind = "token-topk"
    top_k: int = 2
    balance: BalanceForm = "uniform"
    temperature: float = 0.1
    gamma: float = 0.5
    bias_rate: float = 0.05
    gradient_ema: float = 0.9
    use_feature: bool = True
    use_gradient: bool = True
    optimal: int | None = None
    policy_hidden: int = 64
    interpolation: float | None = None
    noise: float = 0.0


@dataclass(frozen=True)
class ExpertSizes:
    """Hyper-parameters of the expert kinds (CoMiGS App. B.1.2; Hermes §5.1)."""

    lora_rank: int = 8
    lora_alpha: float = 16.0
    rank_stabilised: bool = True  # CoMiGS eq. (5) γ = α/√r; False gives Hu et al.'s α/r (Hermes)
    adapter_rank: int = 16
    prefix_length: int = 16


@dataclass(frozen=True)
class Layout:
    """What one device holds at every block (see the module docstring)."""

    experts: tuple[ExpertSpec, ...] = ()
    router: RouterSpec = field(default_factory=RouterSpec)
    mixing: Mixing = "mlp"
    attention_lora: RoleName | None = None
    sizes: ExpertSizes = field(default_factory=ExpertSizes)
    adaptor_kinds: AdaptorKinds = field(default_factory=AdaptorKinds)

    def __post_init__(self) -> None:
        kinds = [e.kind for e in self.experts]
        unknown = sorted(set(kinds) - set(EXPERT_KINDS))
        if unknown:
            raise UserError(f"unknown expert kind(s) {unknown}", f"use some of {list(EXPERT_KINDS)}")
        if (self.mixing == "layer-copies") != ("layer-copy" in kinds) or (
                self.mixing == "layer-copies" and (self.experts != (ExpertSpec("layer-copy", "private"),)
                                                   or self.router.kind != "instance-policy")):
            raise UserError(f"mixing '{self.mixing}' with experts {kinds} under router '{self.router.kind}'",
                            "Flow's layout is mixing layer-copies, one private layer-copy expert, router "
                            "instance-policy; the other mixings take no layer-copy experts")
        client_kind = CLIENT_LEVEL_KINDS.get(self.mixing)
        if (client_kind is not None and set(kinds) != {client_kind}) or \
                (client_kind is None and set(kinds) & set(CLIENT_LEVEL_KINDS.values())):
            raise UserError(f"mixing '{self.mixing}' cannot hold experts of kinds {sorted(set(kinds))}",
                            "every-layer mixing takes `layers` experts, ensemble mixing `model` experts, "
                            "and the other mixings the PEFT kinds")
        if client_kind is not None and self.router.kind not in ("client-mixture", "none"):
            raise UserError(f"mixing '{self.mixing}' mixes experts per client, not with router "
                            f"'{self.router.kind}'", "use router client-mixture (or none for one expert)")
        # A token top-k router takes min(k, n) experts (CoMiGS-1GXs devices hold 1 to n);
        # Hermes's k is a choice of the method (Fig. 3a), so a k above n is a mistake.
        if self.router.kind == "hermes" and self.experts and not 1 <= self.router.top_k <= len(self.experts):
            raise UserError(
                f"top_k = {self.router.top_k} but each block holds {len(self.experts)} expert(s) {kinds}",
                f"set top_k between 1 and {len(self.experts)}",
            )
        if self.mixing == "mlp" and "prefix" in kinds:
            raise UserError("prefix experts sit inside attention, not in the MLP mixture",
                            "use `mixing: block` for layouts with prefix experts")
        if self.mixing == "mlp" and self.router.kind in ("none", "sigmoid") and len(self.experts) > 1:
            raise UserError(f"the exact MLP mixture needs weights that sum to one; router '{self.router.kind}' "
                            "does not give them", "use router uniform, token-topk or hermes, or `mixing: block`")

    @property
    def expert_names(self) -> list[str]:
        """``<role>_<i>``, numbered within each role in layout order."""
        counts = {"shared": 0, "private": 0}
        names = []
        for expert in self.experts:
            names.append(f"{expert.role}_{counts[expert.role]}")
            counts[expert.role] += 1
        return names

    @property
    def uses_prefix(self) -> bool:
        return any(e.kind == "prefix" for e in self.experts)


def lora_experts(roles: tuple[RoleName, ...]) -> tuple[ExpertSpec, ...]:
    """LoRA experts of the given roles, in order."""
    return tuple(ExpertSpec("lora", role) for role in roles)
