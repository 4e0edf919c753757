"""``mixing: every-layer`` and ``ensemble`` (FLoRAL §3.2, §5; Tables 1, 3): one client-level router π
and, per expert, adaptors on every layer or a whole copy of a small network."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.experts.layer import AdaptedLayer, layer_adaptor
from ondevice_moe.experts.lora import gated
from ondevice_moe.layout.building import ExpertBuilder, adaptable_layers, under
from ondevice_moe.layout.spec import Layout
from ondevice_moe.routing import ClientMixtureRouter


def attach_client_mixture(model: nn.Module, layout: Layout, builder: ExpertBuilder, own: tuple[str, ...]) -> None:
    """FLoRAL: one client-level router (``model.router``, private) and, per expert, adaptors on
    every layer (``every-layer``; of a Hugging Face model, every layer of its blocks and of the
    task head ``own``) or a whole copy of the network (``ensemble``)."""
    names = layout.expert_names
    spec = layout.router
    router = ClientMixtureRouter(len(names), spec.optimal, spec.noise) if spec.kind == "client-mixture" else None
    gates = [router.gate(i) if router is not None else always_on for i in range(len(names))]
    if router is not None:
        model.router = router
        model.register_forward_pre_hook(router.resample)
    if layout.mixing == "ensemble":
        net = getattr(model, "net", None)
        if not isinstance(net, nn.Module) or hasattr(model, "config"):
            raise UserError("an ensemble of whole models is built for the small models (linear, mlp, cnn)",
                            "use every-layer adaptors on Hugging Face models")
        model.net = EnsembleNet({name: fresh_copy(net, builder, name) for name in names}, gates)
        return
    for path, layer in adaptable_layers(model, own):
        adapted = None
        kinds = layout.adaptor_kinds
        rank = kinds.head_rank if under(path, own) else None
        for name, gate in zip(names, gates, strict=True):
            adaptor = layer_adaptor(layer, kinds, builder.generator(0, path, name), rank)
            if adaptor is None:
                break
            if adapted is None:
                adapted = AdaptedLayer(layer)
                parent, _, leaf = path.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, leaf, adapted)
            adapted.add(name, adaptor, gate)


def always_on() -> None:
    """No gate: the expert is always on (a tensor made here would sit on torch's default device)."""
    return None


def fresh_copy(net: nn.Module, builder: ExpertBuilder, name: str) -> nn.Module:
    """A copy of ``net`` re-initialised from the seed and the expert's name (the same on every
    device for a shared expert), trainable."""
    copy_ = copy.deepcopy(net)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(builder.generator(0, "ensemble", name).initial_seed()))
        for module in copy_.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return copy_.requires_grad_(True)


class EnsembleNet(nn.Module):
    """FLoRAL's Ensemble baseline: ``Σ_c π_c f_c(x)`` over whole copies ``f_c`` of a network."""

    def __init__(self, experts: dict[str, nn.Module], gates: list) -> None:
        super().__init__()
        self.experts = nn.ModuleDict(experts)
        self.gates = gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(gated(gate(), expert(x)) for gate, expert in zip(self.gates, self.experts.values(), strict=True))
