"""Where experts go for each architecture, and the surgery that puts them there.

CoMiGS App. B.1.2: LoRA on every linear layer of attention and MLP; the
router and the expert mixture sit on the MLP. For GPT-2 the linear layers are
``Conv1D`` (``c_attn``, ``c_proj``, ``c_fc``); for LLaMA they are ``Linear``
(``q/k/v/o_proj``, ``gate/up/down_proj``).

:func:`attach_experts` returns a *new* module tree that shares the frozen base
weights with the model it was given, so one process can hold several expert
layouts (e.g. CoMiGS-1GXs users with different expert counts) over a single
copy of the base model.
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.experts import LoRA, LoRAAdaptedLinear, linear_features
from ondevice_moe.mixture import MixedForward, MixtureMLP, gpt2_mixed_forward, llama_mixed_forward
from ondevice_moe.routing import TokenTopKRouter, UniformRouter
from ondevice_moe.routing.routers import BalanceForm


@dataclass(frozen=True)
class Architecture:
    """Names of the blocks and linear layers of one model family."""

    blocks_path: str
    attention: str
    attention_linears: tuple[str, ...]
    mlp: str
    mlp_linears: tuple[str, ...]
    mixed_forward: MixedForward


ARCHITECTURES: dict[str, Architecture] = {
    "gpt2": Architecture("transformer.h", "attn", ("c_attn", "c_proj"), "mlp", ("c_fc", "c_proj"), gpt2_mixed_forward),
    "llama": Architecture(
        "model.layers",
        "self_attn",
        ("q_proj", "k_proj", "v_proj", "o_proj"),
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
        llama_mixed_forward,
    ),
}


@dataclass(frozen=True)
class ExpertLayout:
    """What one device holds.

    ``attention_roles``: the LoRA adapters on each attention projection, by role
    (``("shared",)`` for federated methods, ``("private",)`` for local ones).
    ``mlp_experts``: the MLP experts by key, ``shared_<i>`` (generalists) or
    ``private_<i>`` (specialists). ``router``: ``topk`` (learned) or ``uniform``.
    """

    attention_roles: tuple[str, ...] = ("shared",)
    mlp_experts: tuple[str, ...] = ("shared_0", "private_0")
    router: Literal["topk", "uniform"] = "topk"
    rank: int = 8
    alpha: float = 16.0
    top_k: int = 2
    balance_form: BalanceForm = "uniform"

    @property
    def num_experts(self) -> int:
        return len(self.mlp_experts)


def architecture_of(model: nn.Module) -> Architecture:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UserError(
            f"model type {model_type!r} has no expert placement for causal-LM mixtures",
            f"use a GPT-2 or LLaMA-architecture model ({', '.join(ARCHITECTURES)})",
        )
    return ARCHITECTURES[model_type]


def expert_generator(seed: int, *parts: object) -> torch.Generator:
    """A generator whose seed depends only on ``seed`` and the expert's identity."""
    key = ":".join(str(p) for p in (seed, *parts))
    return torch.Generator().manual_seed(zlib.crc32(key.encode()))


def _init_seed_parts(role_key: str, user: int) -> tuple[object, ...]:
    """Shared experts start identical on all devices; private ones differ per user."""
    return (role_key,) if role_key.startswith("shared") else (role_key, "user", user)


def frozen_copy(base_model: nn.Module, own: tuple[str, ...] = ()) -> nn.Module:
    """A structural copy of ``base_model`` that shares its frozen weights.

    Parameters under the module paths in ``own`` (e.g. a classification head
    that each device trains) are copied instead, so training them never
    touches the shared base. Every parameter of the copy starts frozen.
    """
    shared = {
        id(tensor): tensor
        for name, tensor in (*base_model.named_parameters(), *base_model.named_buffers())
        if not any(name == path or name.startswith(path + ".") for path in own)
    }
    model = copy.deepcopy(base_model, memo=shared)
    model.requires_grad_(False)
    return model


def attach_experts(base_model: nn.Module, layout: ExpertLayout, *, seed: int, user: int = 0) -> nn.Module:
    """Return a copy of ``base_model`` (sharing its frozen weights) with experts attached."""
    arch = architecture_of(base_model)
    model = frozen_copy(base_model)

    blocks = model.get_submodule(arch.blocks_path)
    hidden_size = model.config.hidden_size
    for index, block in enumerate(blocks):
        attention = block.get_submodule(arch.attention)
        for name in arch.attention_linears:
            base_linear = getattr(attention, name)
            fan_in, fan_out = linear_features(base_linear)
            adapters = {
                role: LoRA(fan_in, fan_out, layout.rank, layout.alpha,
                           expert_generator(seed, index, arch.attention, name, *_init_seed_parts(role, user)))
                for role in layout.attention_roles
            }
            if adapters:
                setattr(attention, name, LoRAAdaptedLinear(base_linear, adapters))

        if not layout.mlp_experts:
            continue
        mlp = block.get_submodule(arch.mlp)
        experts = {}
        for key in layout.mlp_experts:
            experts[key] = nn.ModuleDict({
                name: LoRA(*linear_features(getattr(mlp, name)), layout.rank, layout.alpha,
                           expert_generator(seed, index, arch.mlp, name, *_init_seed_parts(key, user)))
                for name in arch.mlp_linears
            })
        setattr(block, arch.mlp, MixtureMLP(mlp, experts, _make_router(layout, hidden_size), arch.mixed_forward))
    return model


def _make_router(layout: ExpertLayout, hidden_size: int) -> TokenTopKRouter | UniformRouter:
    if layout.router == "uniform" or layout.num_experts == 1:
        return UniformRouter(layout.num_experts)
    return TokenTopKRouter(hidden_size, layout.num_experts, min(layout.top_k, layout.num_experts), layout.balance_form)
