"""``mixing: block`` (Hermes §4.2): one router per block on its input (eq. 4); each expert's residual
gated where it sits (eq. 9): LoRA on the routed projections, adapters after the FFN, prefixes inside
attention."""

from __future__ import annotations

from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.experts import LoRAAdaptedLinear
from ondevice_moe.experts.adapter import AdapterAfter
from ondevice_moe.experts.prefix import register_prefix_attention
from ondevice_moe.layout.building import ExpertBuilder, add_residual, blocks_with_attention_lora
from ondevice_moe.layout.routers import make_router
from ondevice_moe.layout.sites import Sites
from ondevice_moe.layout.spec import Layout
from ondevice_moe.routing.block import BlockRouter, route_block_input
from ondevice_moe.routing.hermes import HermesRouter


def attach_block_mixture(model: nn.Module, layout: Layout, builder: ExpertBuilder, own: tuple[str, ...]) -> None:
    """Every block: the attention LoRA (if any), then the layout's experts under the block's router."""
    if layout.uses_prefix:
        use_prefix_attention(model)
    for sites, index, block in blocks_with_attention_lora(model, layout, builder):
        _route_block(block, sites, layout, builder, index, model.config)


def _route_block(block: nn.Module, sites: Sites, layout: Layout, builder: ExpertBuilder, index: int,
                 config) -> None:
    """Hermes: one router per block on its input; each expert's residual gated where it sits."""
    names = layout.expert_names
    router = (BlockRouter(make_router(layout, config.hidden_size, builder.router_generator(index)), names)
              if layout.router.kind != "none" else None)
    expert_params: dict[str, list[nn.Parameter]] = {}
    for spec, name in zip(layout.experts, names, strict=True):
        gate = router.gate(name) if router is not None else None
        modules: list[nn.Module] = []
        if spec.kind == "lora":
            for path in sites.routed_lora:
                lora = builder.lora(block, path, index, name, spec.rank)
                add_residual(block, path, name, lora, gate, LoRAAdaptedLinear)
                modules.append(lora)
        elif spec.kind == "adapter":
            adapter = builder.adapter(index, sites.ffn_output, name)
            add_residual(block, sites.ffn_output, name, adapter, gate, AdapterAfter)
            modules.append(adapter)
        else:
            attention = block.get_submodule(sites.attention)
            if not hasattr(attention, "prefix"):
                attention.prefix = nn.ModuleDict()
                attention.prefix_gates = {}
            prefix = builder.prefix(index, name)
            attention.prefix[name] = prefix
            if gate is not None:
                attention.prefix_gates[name] = gate
            modules.append(prefix)
        expert_params[name] = [p for module in modules for p in module.parameters()]
    if router is not None:
        block.router = router
        if isinstance(router.router, HermesRouter):
            router.router.expert_params = expert_params
        block.register_forward_pre_hook(route_block_input, with_kwargs=True)


def use_prefix_attention(model: nn.Module) -> None:
    name = register_prefix_attention()
    try:
        model.set_attn_implementation(name)
    except (ValueError, AttributeError) as error:
        raise UserError(
            f"prefix experts need a model whose attention takes registered attention functions; "
            f"{type(model).__name__} does not ({error})",
            "drop `prefix` from the expert kinds, or use a BERT/RoBERTa, GPT-2 or LLaMA model",
        ) from None
