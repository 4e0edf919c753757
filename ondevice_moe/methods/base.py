"""What a method is: a layout of experts per device, a local procedure, and a server rule.

* **layout** (:class:`~ondevice_moe.layout.Layout`, one per device): which
  experts, of which kinds and roles, under which router;
* **procedure** (:class:`Procedure`): the device's phases each round — which
  parameters train on which split, and how often;
* **server rule** (:class:`~ondevice_moe.federation.rules.ServerRule`): what
  the server keeps, sends and how uploads combine.

Parameter names carry roles (``adapters.shared``, ``experts.private_0``,
``router``), so which tensors leave the device follows from
:meth:`Method.role_of` and the method's :class:`Sharing` exceptions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ondevice_moe.federation.rules import ServerRule
from ondevice_moe.layout import Layout


class Role(str, Enum):
    """``shared`` tensors travel to the server and are aggregated; ``private`` never leave the device."""

    SHARED = "shared"
    PRIVATE = "private"


class MethodOptions(BaseModel):
    """A method's options in a recipe entry; each method subclasses it.

    ``label`` names the method's results (default: derived from the options),
    so two entries of one method can stand side by side.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str | None = None


@dataclass(frozen=True)
class MethodContext:
    """What a method is built from besides its own options: the number of
    devices, the federation's weighting of device updates and the task's
    ground-truth clusters (``None`` where it has none; client ``k`` belongs to
    cluster ``k mod C``, as :mod:`ondevice_moe.data.small` deals them) and the
    recipe's seed (FedSoft's client selection draws from it)."""

    num_users: int
    weighting: str = "uniform"
    clusters: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class CentreProcedure:
    """A round against the server's cluster centres (:mod:`ondevice_moe.methods.fedsoft`).

    ``soft`` (FedSoft Alg. 1): the device trains its own persistent model on eq. (4),
    anchored to every centre by its importance weights, re-estimated every
    ``estimation_interval`` rounds with floor ``importance_floor``; ``proximal_lambda``
    is λ. ``hard`` (IFCA): the device trains the centre with the lowest loss on its data.
    ``em`` (FedEM, Marfoq et al. 2021): the device weighs each example over all centres (E-step),
    sets its mixture π from them (M-step) and trains every centre on its weighted loss.
    ``lora_spread``: the std of a LoRA centre's ``B`` at the start (cluster adapters on a
    Hugging Face model; the centres must start apart). ``block_loss``: FedEM's E-step score of a
    block of text, its summed (``sum``, the paper) or mean (``mean``, the authors' code) token loss.
    ``scored_on``: the split of a language model's blocks the centres are scored on for the
    importances or IFCA's choice (``train``, the paper, or ``valid``); FedEM trains on its E-step's
    weights and so always scores the training blocks.
    """

    assignment: Literal["soft", "hard", "em"]
    proximal_lambda: float = 0.0
    estimation_interval: int = 1
    importance_floor: float = 0.0
    lora_spread: float = 0.0
    block_loss: Literal["sum", "mean"] = "sum"
    scored_on: Literal["train", "valid"] = "train"

    @property
    def trains_every_centre(self) -> bool:
        """FedEM: the device trains and sends every centre, not one model."""
        return self.assignment == "em"


@dataclass(frozen=True)
class FlowProcedure:
    """Flow's round (Alg. 1, :mod:`ondevice_moe.methods.flow`): the local copies restart from the
    global layers, the device's training examples are split in two disjoint halves ζ_ℓ / ζ_g
    (``local_fraction`` of them in ζ_ℓ); ``local_epochs`` (K₁) epochs train
    the local copies on ζ_ℓ (eq. 1); ``global_epochs`` (K₂) epochs on ζ_g alternate, batch by
    batch, a policy step with the regulariser weight ``gamma`` (γ, eq. 4) and a global step
    (eq. 5). ``policy``: ``learned`` (Flow), ``fixed-paths`` (FedAvgFT: the global layers
    train on ζ_g alone and the personal model is the local path) or ``ditto`` (Ditto, Li et
    al. 2021: on all the examples, ``global_epochs`` of the global layers, then ``local_epochs``
    of the local copies — kept between rounds, not restarted — on the loss plus
    ``(proximal_lambda/2)·‖w_ℓ − w_g^t‖²`` to the round's received global layers; the personal
    model is the local path) or ``apfl`` (APFL, Deng et al. 2020, Alg. 1: on all the examples,
    each batch a step of the global layers on their own loss, then a step of the local copies
    and the private α on the loss of ``(1 − α)·w_g + α·w_ℓ``; the personal model is that
    interpolation). ``global_step``: the global
    step's loss, ``CE(w_p)`` (``personalised``, eq. 5) or ``CE(w_g)`` on the global path alone
    (``global-path``, the authors' ``trainers/client_flow.py``). ``zeta_split``: ``per-round``
    draws the halves and the batch order afresh each round (Alg. 1 line 6 sits in the round
    loop), ``fixed`` keeps them for every round (the authors' code shards the same way).
    ``evaluation``: ``as-trained`` scores the model the rounds left; ``adapted`` first restarts
    the local copies from the received global layers, fine-tunes them on ζ_ℓ and adapts ψ on
    ζ_g, as the authors' ``*_generalized_test`` does. ``baseline_budget``: ``paper`` runs the
    baselines as their papers define them (FedAvgFT: FedAvg and the fine-tuning on every example;
    Ditto and APFL: every example through both models), ``flow`` on Flow's data per round (the
    global layers on ζ_g, the personal model on ζ_ℓ)."""

    gamma: float = 0.01
    local_epochs: int = 1
    global_epochs: int = 1
    local_fraction: float = 0.5
    policy: Literal["learned", "fixed-paths", "ditto", "apfl"] = "learned"
    global_step: Literal["personalised", "global-path"] = "personalised"
    proximal_lambda: float = 0.0
    zeta_split: Literal["per-round", "fixed"] = "per-round"
    evaluation: Literal["as-trained", "adapted"] = "as-trained"
    baseline_budget: Literal["paper", "flow"] = "paper"


@dataclass(frozen=True)
class Procedure:
    """A device's local work each round.

    ``experts`` phase: the experts (and task head) train on the ``train``
    split every iteration. ``routers``: ``none`` (no learned router),
    ``joint`` (routers train with the experts on the training loss: Hermes,
    Local-MoE) or ``bilevel`` (CoMiGS Alg. 1: a router phase of
    ``router_steps`` steps on the ``router_data`` split every τ iterations,
    experts held fixed). ``full_finetune`` trains every weight of the base (FedFT).
    ``peer_mixing``: a round may start by averaging peers' models with trust
    weights from the validation split (PCL, :mod:`ondevice_moe.federation.peers`).
    ``experts_in_turn``: each expert step trains one expert of each client-level
    router alone, in turn, and the device's expert weights are fitted on the
    validation split before it is tested (FDLoRA, :mod:`ondevice_moe.routing.fusion`).
    ``pruning_lambda`` > 0: HetLoRA's rank self-pruning penalty with strength
    ``pruning_strength``, and ranks the server cut held at zero
    (:mod:`ondevice_moe.federation.rank_pruning`). ``lora_preconditioning``: every
    LoRA and ConvLoRA gradient is preconditioned before the step (FLoRAL App. D,
    :mod:`ondevice_moe.experts.preconditioning`). ``joint_router_lr``: joint routers
    train in their own parameter group at this rate (FLoRAL's code trains θ at
    0.1 beside weights at 0.03 on the synthetic MLP); ``None``: at the experts' rate.
    ``centres``: the round starts from the server's cluster centres (FedSoft, IFCA).
    ``flow``: Flow's three-phase round (:class:`FlowProcedure`) replaces the expert steps.
    """

    routers: Literal["none", "joint", "bilevel"] = "none"
    router_data: Literal["valid", "train"] = "valid"
    full_finetune: bool = False
    peer_mixing: bool = False
    experts_in_turn: bool = False
    pruning_lambda: float = 0.0
    pruning_strength: float = 0.99
    lora_preconditioning: bool = False
    joint_router_lr: float | None = None
    centres: CentreProcedure | None = None
    flow: FlowProcedure | None = None


@dataclass(frozen=True)
class Sharing:
    """Exceptions to "shared experts travel, private ones stay".

    ``frozen_matrices`` are never trained, so never sent (FFA-LoRA freezes
    ``lora_A``); ``private_matrices`` stay home even inside shared experts
    (FedSA-LoRA keeps ``lora_B``); ``share_router`` sends routers too
    (FedAvg-MoE); ``selected_only``: an expert no token chose this round stays
    home (Hermes §4.3); ``devices_keep_models``: a device also keeps its shared
    tensors between rounds, because the server sends back no average (PCL).
    """

    frozen_matrices: frozenset[str] = frozenset()
    private_matrices: frozenset[str] = frozenset()
    share_router: bool = False
    selected_only: bool = False
    devices_keep_models: bool = False


@dataclass(frozen=True)
class Method:
    """A method of the harness, resolved for one recipe.

    ``layouts[i]`` is device ``i``'s layout (``None``: no experts — the
    pretrained model, or full fine-tuning). ``centralized``: one device
    holds every user's training data (an upper bound).
    """

    name: str
    layouts: tuple[Layout | None, ...]
    procedure: Procedure = field(default_factory=Procedure)
    server_rule: ServerRule = field(default_factory=ServerRule)
    sharing: Sharing = field(default_factory=Sharing)
    centralized: bool = False

    @property
    def trains(self) -> bool:
        return self.procedure.full_finetune or any(layout is not None for layout in self.layouts)

    def role_of(self, name: str) -> Role:
        """The role of a trainable parameter, from its name."""
        parts = name.split(".")
        if "router" in parts:
            return Role.SHARED if self.sharing.share_router else Role.PRIVATE
        if any(part.startswith("private") for part in parts):
            return Role.PRIVATE
        if parts[-1] in self.sharing.private_matrices:
            return Role.PRIVATE
        if parts[-1] in self.sharing.frozen_matrices:
            # Frozen matrices start identical on every device (same seed) and
            # never change, so there is nothing to send.
            return Role.PRIVATE
        return Role.SHARED

    def is_trainable(self, name: str) -> bool:
        """Whether the local procedure updates this expert or router parameter."""
        parts = name.split(".")
        if "router" in parts:
            return self.procedure.routers != "none"
        return parts[-1] not in self.sharing.frozen_matrices


EXPERT_SEGMENTS = frozenset({"adapters", "experts", "prefix", "router"})


def is_expert_tensor(name: str) -> bool:
    """Whether a parameter belongs to an expert or a router (by the module names the
    layout gives them); anything else trainable is a task head, or the base when fully fine-tuned."""
    return not EXPERT_SEGMENTS.isdisjoint(name.split("."))


def same_for_all(num_users: int, layout: Layout | None) -> tuple[Layout | None, ...]:
    """The same layout on every device."""
    return tuple(layout for _ in range(num_users))
