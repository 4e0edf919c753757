"""FLoRAL and the baselines of its Tables 1 and 3, as layouts, procedures and server rules.

* ``floral`` (§5, Alg. 1): C experts, each a set of adaptors on every layer
  (:mod:`ondevice_moe.experts.layer`), mixed by the client's private
  ``π = softmax(θ)`` (FML: one forward pass through ``u + Σ_c π_c a_c``); local
  SGD on the base, the adaptors and θ; preconditioned LoRA gradients (App. D);
  the server averages the base by ``N^k`` and adaptor ``c`` by ``π_c^k N^k``.
  ``optimal_routing``: π fixed to the client's cluster (π*).
* ``ensemble``: C whole models mixed the same way, ``Σ_c π_c f_c(x)``.
* ``local-adaptor``: one private adaptor per client on the shared base (the
  authors' ``floral_locallora``: C = 1, adaptors private).
* FedAvg is ``fed-ft`` (FedAvg of the whole model); ``fedavg-adaptor`` is FedAvg of one shared
  adaptor on every layer (with ``rank_multiple: C``, FLoRAL's C adaptors' LoRA parameters in one).
"""

from __future__ import annotations

from ondevice_moe.errors import UserError
from ondevice_moe.experts.layer import AdaptorKinds
from ondevice_moe.layout import ExpertSpec, Layout, RouterSpec
from ondevice_moe.methods.base import Method, MethodContext, same_for_all
from ondevice_moe.methods.floral.config import FedAvgAdaptorOptions, FLoRALOptions, FLoRALSizes, LocalAdaptorOptions
from ondevice_moe.methods.floral.procedure import AdaptorProcedure
from ondevice_moe.methods.floral.rule import MixtureRule
from ondevice_moe.server_rules.rules import ServerRule


def _clusters(options: FLoRALSizes, context: MethodContext) -> int:
    clusters = options.clusters or context.clusters
    if clusters is None:
        raise UserError("FLoRAL needs a number of experts C: this task has no ground-truth clusters",
                        "set `clusters` in the recipe's floral: section (the paper uses C = 4 for MNIST)")
    return clusters


def _kinds(options: FLoRALSizes) -> AdaptorKinds:
    return AdaptorKinds(budget=options.budget, conv=None if options.conv_lora == "none" else options.conv_lora,
                        bias=options.bias, norm=options.norm, head_rank=options.head_rank,
                        rank_multiple=options.rank_multiple, lora_scale=options.lora_scale)


def _routers(options: FLoRALOptions, context: MethodContext, clusters: int) -> list[RouterSpec]:
    """Each device's router: learned θ, or π* on its cluster ``k mod C`` (App. G's diagonal router)."""
    if options.optimal_routing and context.clusters is None:
        raise UserError("optimal routing (π*) needs a task with ground-truth clusters",
                        "drop optimal_routing, or use a clustered task (floral-*, digits-rotate, ...)")
    return [RouterSpec("client-mixture", optimal=device % clusters if options.optimal_routing else None,
                       noise=options.router_noise)
            for device in range(context.num_users)]


def _suffix(options: FLoRALOptions) -> str:
    if options.optimal_routing:
        return "-optimal"
    return f"-noise{options.router_noise:g}" if options.router_noise > 0 else ""


def floral(options: FLoRALOptions, context: MethodContext) -> Method:
    """FLoRAL(ρ): C shared adaptors on every layer, mixed per client (Alg. 1)."""
    clusters = _clusters(options, context)
    experts = tuple(ExpertSpec("layers", "shared") for _ in range(clusters))
    layouts = tuple(Layout(experts, router, "every-layer", adaptor_kinds=_kinds(options))
                    for router in _routers(options, context, clusters))
    procedure = AdaptorProcedure(routers="none" if options.optimal_routing else "joint",
                                 full_finetune=options.train_base, lora_preconditioning=options.preconditioning,
                                 joint_router_lr=options.router_lr)
    return Method(f"floral-{options.budget * 100:g}pct{_suffix(options)}", layouts, procedure,
                  MixtureRule(context.weighting))


def ensemble(options: FLoRALOptions, context: MethodContext) -> Method:
    """Ensemble: C whole models mixed per client (FLoRAL Tables 1 and 3)."""
    clusters = _clusters(options, context)
    experts = tuple(ExpertSpec("model", "shared") for _ in range(clusters))
    layouts = tuple(Layout(experts, router, "ensemble") for router in _routers(options, context, clusters))
    # AdaptorProcedure: its π travels with the models, so the server weighs model c by π_c (Alg. 1 line 12).
    procedure = AdaptorProcedure(routers="none" if options.optimal_routing else "joint", full_finetune=True,
                                 joint_router_lr=options.router_lr)
    return Method(f"ensemble{_suffix(options)}", layouts, procedure, MixtureRule(context.weighting))


def local_adaptor(options: LocalAdaptorOptions, context: MethodContext) -> Method:
    """Local Adaptor: a shared base and one private adaptor per client (FLoRAL Tables 1 and 3)."""
    layout = Layout((ExpertSpec("layers", "private"),), RouterSpec("none"), "every-layer",
                    adaptor_kinds=_kinds(options))
    procedure = AdaptorProcedure(full_finetune=options.train_base, lora_preconditioning=options.preconditioning)
    return Method("local-adaptor", tuple(layout for _ in range(context.num_users)), procedure,
                  MixtureRule(context.weighting))


def fedavg_adaptor(options: FedAvgAdaptorOptions, context: MethodContext) -> Method:
    """FedAvg of one shared adaptor on every layer, averaged by examples: FLoRAL's targets and
    adaptor form without the mixture (the equal-parameter baseline with ``rank_multiple: C``)."""
    layout = Layout((ExpertSpec("layers", "shared"),), RouterSpec("none"), "every-layer",
                    adaptor_kinds=_kinds(options))
    procedure = AdaptorProcedure(full_finetune=options.train_base, lora_preconditioning=options.preconditioning)
    return Method("fedavg-adaptor", same_for_all(context.num_users, layout), procedure,
                  ServerRule(context.weighting))
