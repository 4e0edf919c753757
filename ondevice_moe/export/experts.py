"""Which experts a user's model holds, and which of them an export takes.

Every trained tensor belongs to one *part* of the model, named after the path
segment the layout gives it: an expert (``shared_0``, ``private_1``; the
always-on attention LoRA is plainly ``shared`` or ``private``), ``router``,
``head`` (a classifier's head and pooler) or ``model`` (the base's own weights,
when a method trains it whole). Roles follow from names alone
(:meth:`~ondevice_moe.methods.base.Method.role_of`), so private parts — a
user's own — are exported only with ``--experts all``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ondevice_moe.errors import UserError
from ondevice_moe.methods import Role
from ondevice_moe.models.heads import head_paths
from ondevice_moe.run_model import UserModel
from ondevice_moe.training import trainable_state

EXPERT_SEGMENT = re.compile(r"^(shared|private)(_\d+)?$")
SELECTIONS = ("shared", "all")


@dataclass(frozen=True)
class Part:
    """One part of a user's model: its name, kind (an expert kind, ``router``, ``head`` or
    ``model``), role and trained tensors (toolkit parameter names)."""

    name: str
    kind: str
    role: Role
    tensors: dict[str, torch.Tensor]

    @property
    def is_attention_lora(self) -> bool:
        """The always-on LoRA on every attention projection (CoMiGS App. B.1.2)."""
        return self.name in ("shared", "private")


def part_of(name: str, heads: tuple[str, ...]) -> str:
    """The part a trained tensor belongs to, from its parameter name."""
    parts = name.split(".")
    expert = next((segment for segment in parts if EXPERT_SEGMENT.match(segment)), None)
    if expert is not None:
        return expert
    if "router" in parts:
        return "router"
    if any(name.startswith(head + ".") for head in heads):
        return "head"
    return "model"


def model_parts(user_model: UserModel) -> dict[str, Part]:
    """The trained parts of a user's model, in parameter order."""
    method = user_model.job.method
    layout = method.layouts[user_model.device]
    kinds = dict(zip(layout.expert_names, (e.kind for e in layout.experts), strict=True)) if layout else {}
    heads = () if user_model.recipe.is_language_modelling else head_paths(user_model.model)
    roles = method.roles(user_model.model)
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in trainable_state(user_model.model).items():
        grouped.setdefault(part_of(name, heads), {})[name] = tensor
    parts = {}
    for name, tensors in grouped.items():
        kind = kinds.get(name, "lora" if EXPERT_SEGMENT.match(name) else name)
        # A tensor the method never trains (FFA-LoRA's frozen A) is the same on every device.
        private = any(roles[t] is Role.PRIVATE and method.is_trainable(t) for t in tensors)
        role = Role.PRIVATE if private else Role.SHARED
        parts[name] = Part(name, kind, role, tensors)
    return parts


def select_parts(parts: dict[str, Part], experts: list[str]) -> dict[str, Part]:
    """The parts ``--experts`` asks for: ``shared`` (the default: every shared part), ``all``,
    or expert names (shared ones; private parts are a user's own and need ``all``). The task
    head always comes along: an expert of a classifier is useless without it."""
    if not parts:
        raise UserError("this method trains nothing: there is nothing to export",
                        "export a method that trains experts (see the run's report.md)")
    choices = ", ".join([*SELECTIONS, *(name for name in parts if name != "head")])
    if experts in (["shared"], []):
        chosen = [name for name, part in parts.items() if part.role is Role.SHARED]
    elif experts == ["all"]:
        chosen = list(parts)
    else:
        unknown = [name for name in experts if name not in parts or name in SELECTIONS]
        if unknown:
            raise UserError(f"no expert {', '.join(map(repr, unknown))} in this model", f"use one of: {choices}")
        private = [name for name in experts if parts[name].role is Role.PRIVATE]
        if private:
            raise UserError(f"{', '.join(private)} {'is' if len(private) == 1 else 'are'} private: the user's "
                            "own, never shared", "pass --experts all to export private experts too")
        chosen = [*experts, *(["head"] if "head" in parts else [])]
    selected = {name: parts[name] for name in parts if name in chosen}
    if not set(selected) - {"head"}:
        raise UserError("every expert of this model is private: --experts shared selects nothing",
                        "pass --experts all to export the user's private experts")
    return selected
