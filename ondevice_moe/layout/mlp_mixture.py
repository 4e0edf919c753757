"""``mixing: mlp`` (CoMiGS §2, App. B.1.2): each block's MLP becomes the exact router-weighted mixture
of expert MLPs (:class:`~ondevice_moe.mixture.MixtureMLP`)."""

from __future__ import annotations

from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.layout.building import ExpertBuilder, blocks_with_attention_lora
from ondevice_moe.layout.routers import make_router
from ondevice_moe.layout.sites import Sites
from ondevice_moe.layout.spec import Layout
from ondevice_moe.mixture import MixtureMLP
from ondevice_moe.routing.hermes import HermesRouter


def attach_mlp_mixture(model: nn.Module, layout: Layout, builder: ExpertBuilder, own: tuple[str, ...]) -> None:
    """Every block: the attention LoRA (if any), then the MLP mixture of the layout's experts."""
    for sites, index, block in blocks_with_attention_lora(model, layout, builder):
        _mix_block_mlp(block, sites, layout, builder, index, model.config.hidden_size)


def _mix_block_mlp(block: nn.Module, sites: Sites, layout: Layout, builder: ExpertBuilder, index: int,
                   hidden_size: int) -> None:
    """CoMiGS: the block's MLP becomes an exact router-weighted mixture of expert MLPs."""
    if sites.mlp is None or sites.mixed_forward is None:
        raise UserError("this architecture has no separable MLP for the exact CoMiGS mixture",
                        "use `mixing: block` (experts gated where they sit) on BERT/RoBERTa")
    mlp = block.get_submodule(sites.mlp)
    experts: dict[str, nn.Module] = {}
    for spec, name in zip(layout.experts, layout.expert_names, strict=True):
        if spec.kind == "adapter":
            experts[name] = builder.adapter(index, sites.mlp, name)
        else:
            experts[name] = nn.ModuleDict({
                linear: builder.lora(mlp, linear, index, name, spec.rank) for linear in sites.mlp_linears})
    router = make_router(layout, hidden_size, builder.router_generator(index))
    register_expert_params(router, experts)
    setattr(block, sites.mlp, MixtureMLP(mlp, experts, router, sites.mixed_forward))


def register_expert_params(router: nn.Module, experts: dict[str, nn.Module]) -> None:
    if isinstance(router, HermesRouter):
        router.expert_params = {name: list(expert.parameters()) for name, expert in experts.items()}
