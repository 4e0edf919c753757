"""What a method is: a layout of experts per device, a local procedure, and a server rule.

* **layout** (:class:`~ondevice_moe.layout.Layout`, one per device): which
  experts, of which kinds and roles, under which router;
* **procedure** (:class:`Procedure`): the device's phases each round — which
  parameters train on which split, and how often;
* **server rule** (:class:`~ondevice_moe.server_rules.rules.ServerRule`): what
  the server keeps, sends and how uploads combine.

Parameter names carry roles (``adapters.shared``, ``experts.private_0``,
``router``), and a method may keep whole modules home (``Sharing.private_modules``):
which tensors leave the device follows from :meth:`Method.roles`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

from pydantic import BaseModel, ConfigDict
from torch import nn

from ondevice_moe.layout import Layout
from ondevice_moe.methods.procedure import Procedure
from ondevice_moe.models.heads import output_layer_paths
from ondevice_moe.server_rules.rules import ServerRule

HEAD = "@head"
"""In ``Sharing.private_modules``: the model's task head, whatever its module path
(:func:`~ondevice_moe.models.heads.output_layer_paths`)."""


class Role(str, Enum):
    """``shared`` tensors travel to the server and are aggregated; ``private`` never leave the device."""

    SHARED = "shared"
    PRIVATE = "private"


MAX_RANK = 4096  # no expert's rank is wider than the widest layer of the models the toolkit runs


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
class Sharing:
    """Exceptions to "shared experts travel, private ones stay".

    ``frozen_matrices`` are never trained, so never sent (FFA-LoRA freezes
    ``lora_A``); ``private_matrices`` stay home even inside shared experts
    (FedSA-LoRA keeps ``lora_B``); ``share_router`` sends routers too
    (FedAvg-MoE); ``selected_only``: an expert no token chose this round stays
    home (Hermes §4.3); ``devices_keep_models``: a device also keeps its shared
    tensors between rounds, because the server sends back no average (PCL);
    ``private_modules``: module paths of the model whose every parameter stays home,
    :data:`HEAD` for the task head (FedPer, Arivazhagan et al. 2019: a shared body, a private head).
    """

    frozen_matrices: frozenset[str] = frozenset()
    private_matrices: frozenset[str] = frozenset()
    share_router: bool = False
    selected_only: bool = False
    devices_keep_models: bool = False
    private_modules: tuple[str, ...] = ()


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

    def roles(self, model: nn.Module) -> dict[str, Role]:
        """The role of every parameter and buffer of ``model``: the one answer to "what is shared, what
        stays home" that the device, the server's upload reference, ``--dry-run``, export and the byte
        accounting all ask. A tensor under one of ``sharing.private_modules`` is private; any other
        follows its name (:meth:`role_of`)."""
        private = tuple(path for entry in self.sharing.private_modules
                        for path in (output_layer_paths(model) if entry == HEAD else (entry,)))
        names = [name for name, _ in itertools.chain(model.named_parameters(), model.named_buffers())]
        return {name: Role.PRIVATE if any(name.startswith(path + ".") for path in private) else self.role_of(name)
                for name in names}

    def role_of(self, name: str) -> Role:
        """The role of a trainable parameter, from its name alone (see :meth:`roles`)."""
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
