"""What a method is: a layout of experts per device, a rule that says which
parameters are shared with the server, and the device's local procedure.

Parameter names carry roles (``adapters.shared``, ``experts.private_0``, …), so
aggregation, byte counting, checkpointing and export all follow from
:meth:`Method.role_of`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from ondevice_moe.block_experts import BlockLayout
from ondevice_moe.inject import ExpertLayout


class Role(str, Enum):
    """``shared`` tensors travel to the server and are averaged; ``private`` never leave the device."""

    SHARED = "shared"
    PRIVATE = "private"


RouterUpdate = Literal["none", "joint", "bilevel"]
Aggregation = Literal["mean", "inverse_frequency"]


@dataclass(frozen=True)
class Method:
    """A method of the harness, resolved for one recipe.

    ``layouts[i]`` is user ``i``'s expert layout (``None``: no experts, the
    pretrained model). ``router_update``: ``joint`` trains routers with the
    experts on the training loss; ``bilevel`` alternates as CoMiGS Alg. 1.
    ``router_data`` is ``valid`` (CoMiGS) or ``train`` (the ``-tr`` ablation).
    ``frozen_matrices`` are never trained (FFA-LoRA freezes ``lora_A``);
    ``private_matrices`` stay local even inside shared experts (FedSA-LoRA keeps
    ``lora_B``). ``share_router``: the server averages routers too (FedAvg-MoE).
    ``centralized``: one device holds every user's training data.

    For classification (Hermes): ``layouts`` hold :class:`BlockLayout`s;
    ``full_finetune`` trains every weight (FedFT); ``upload_selected_only``
    sends only experts that routed at least one token in the round, with their
    usage counts; ``aggregation="inverse_frequency"`` weighs each upload by
    ``(h + ε)^(−α)`` (Hermes eq. 10–11), task heads by example counts (FedAvg).
    """

    name: str
    layouts: tuple[ExpertLayout | BlockLayout | None, ...]
    router_update: RouterUpdate = "none"
    router_data: Literal["valid", "train"] = "valid"
    frozen_matrices: frozenset[str] = field(default_factory=frozenset)
    private_matrices: frozenset[str] = field(default_factory=frozenset)
    share_router: bool = False
    centralized: bool = False
    full_finetune: bool = False
    upload_selected_only: bool = False
    aggregation: Aggregation = "mean"
    aggregation_alpha: float = 0.5
    aggregation_epsilon: float = 1.0

    @property
    def trains(self) -> bool:
        return self.full_finetune or any(layout is not None for layout in self.layouts)

    def role_of(self, name: str) -> Role:
        """The role of a trainable parameter, from its name."""
        parts = name.split(".")
        if "router" in parts:
            return Role.SHARED if self.share_router else Role.PRIVATE
        if any(part.startswith("private") for part in parts):
            return Role.PRIVATE
        if parts[-1] in self.private_matrices:
            return Role.PRIVATE
        if parts[-1] in self.frozen_matrices:
            # Frozen matrices start identical on every device (same seed) and
            # never change, so there is nothing to send.
            return Role.PRIVATE
        return Role.SHARED

    def is_trainable(self, name: str) -> bool:
        """Whether the local procedure updates this expert or router parameter."""
        parts = name.split(".")
        if "router" in parts:
            return self.router_update != "none"
        return parts[-1] not in self.frozen_matrices
