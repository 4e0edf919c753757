"""``mixing: layer-copies`` (Flow §3, eq. 2–3): every routed layer a global and a private copy, chosen
per instance by the policy network ψ."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.experts import LoRAAdaptedLinear
from ondevice_moe.experts.layer_copy import RoutedLayer
from ondevice_moe.layout.building import ExpertBuilder, adaptable_layers, add_residual, expert_generator, under
from ondevice_moe.layout.sites import sites_of
from ondevice_moe.layout.spec import Layout
from ondevice_moe.routing.instance_policy import GLOBAL, LOCAL, InstancePolicyRouter, SequenceRepresentation


def attach_layer_copies(model: nn.Module, layout: Layout, builder: ExpertBuilder, own: tuple[str, ...]) -> None:
    """Flow: ψ (``model.router``, shared, the same on every device) and a global/local pair for
    every routed layer, layer ``j`` read by exit ``j`` (eq. 2–3).

    A small model: every Linear and Conv2d layer becomes a :class:`RoutedLayer` (the layer and a
    private copy); ψ reads the network's flattened input. A Hugging Face model: each block's
    routed projections (query and value) get a global LoRA expert (``shared_0``) and a local
    one (``private_0``) under one exit per block, and every Linear layer of the task head
    ``own`` (pooler, classifier) becomes a :class:`RoutedLayer`; ψ reads the mean input
    embedding (:class:`SequenceRepresentation`)."""
    if hasattr(model, "config"):
        attach_lora_copies(model, layout, builder, own)
        return
    net = getattr(model, "net", None)
    input_shape = getattr(model, "input_shape", ())
    if not isinstance(net, nn.Module) or not input_shape:
        raise UserError("Flow's global and local layer copies are built for the small models (linear, mlp, cnn) "
                        "and for Hugging Face models with expert sites",
                        "use model.name mlp, cnn or linear, or a GPT-2, LLaMA, BERT or RoBERTa model")
    paths = [path for path, layer in adaptable_layers(model) if isinstance(layer, nn.Linear | nn.Conv2d)]
    router = InstancePolicyRouter(math.prod(input_shape), len(paths), layout.router.policy_hidden,
                                  policy_generator(builder.seed), interpolation=layout.router.interpolation)
    model.router = router
    for index, path in enumerate(paths):
        route_layer_copy(model, path, router, index)
    net.register_forward_pre_hook(router.before_network)


def attach_lora_copies(model: nn.Module, layout: Layout, builder: ExpertBuilder, own: tuple[str, ...]) -> None:
    """Flow on a Hugging Face model (see :func:`attach_layer_copies`)."""
    sites, blocks = sites_of(model)
    head = [path for path, layer in adaptable_layers(model, own)
            if isinstance(layer, nn.Linear) and under(path, own)]
    # A language model (no task head) predicts its own tokens: each position is routed on its context only.
    representation = SequenceRepresentation(model.get_input_embeddings(), causal=not own)
    router = InstancePolicyRouter(model.config.hidden_size, len(blocks) + len(head), layout.router.policy_hidden,
                                  policy_generator(builder.seed), representation, layout.router.interpolation)
    model.router = router
    for index, block in enumerate(blocks):
        for path in sites.routed_lora:
            copies = []
            for name, copy_index in (("shared_0", GLOBAL), ("private_0", LOCAL)):
                lora = builder.lora(block, path, index, name)
                add_residual(block, path, name, lora, router.copy_gate(index, copy_index), LoRAAdaptedLinear)
                copies.append(lora)
            router.pairs.append((copies[0], copies[1]))
    for offset, path in enumerate(head):
        route_layer_copy(model, path, router, len(blocks) + offset)
    model.register_forward_pre_hook(router.before_model, with_kwargs=True)


def policy_generator(seed: int) -> torch.Generator:
    """ψ starts the same on every device: it is shared."""
    return expert_generator(seed, "policy", "router")


def route_layer_copy(model: nn.Module, path: str, router: InstancePolicyRouter, index: int) -> None:
    """Replace the layer at ``path`` by a global and a private copy of it under exit ``index``,
    both trainable. Both are the device's own tensors: the frozen copy of the model shares
    its weights with the base every device starts from."""
    parent, _, leaf = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    routed = RoutedLayer(copy.deepcopy(getattr(owner, leaf)), router.gate(index)).requires_grad_(True)
    setattr(owner, leaf, routed)
    router.pairs.append((routed.base, routed.local))
