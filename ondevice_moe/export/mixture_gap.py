"""How far a routed mixture is from what PEFT can express: its experts merged.

PEFT holds LoRA experts as adapters that are on or off for the whole input; the
closest it comes to a routed mixture is a merge, ``W + Σ_j w_j ΔW_j`` in every
layer the experts adapt (e.g. ``add_weighted_adapter``), with equal weights (the
*average*, ``w_j = 1/n``, which is what FedAvg's fixed weights export as) or all on
(the *sum*, ``w_j = 1``); the always-on attention LoRA stays as it is. An MLP mixture
is ``Σ_j g_j(x) MLP_j(x)``, with weights ``g(x)`` per token (a router) or fixed
(FedAvg's ``1/2``) and a nonlinearity inside each expert, so no merge equals it
(:mod:`~ondevice_moe.export.merge`). :func:`mixture_gap` measures the difference
on a user's test blocks: mean |Δ logit| and perplexity of each model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ondevice_moe.export.merge import merged_lora
from ondevice_moe.likelihood import block_nll, perplexity_of
from ondevice_moe.mixture import mixtures
from ondevice_moe.routing import UniformRouter

GAP_BLOCKS = 8  # test blocks the gap is measured on at export time


@dataclass(frozen=True)
class MixtureGap:
    """Routed mixture vs. its experts merged, on ``blocks`` test blocks of one user."""

    blocks: int
    experts: int
    logit_gap_average: float
    logit_gap_sum: float
    perplexity_routed: float
    perplexity_average: float
    perplexity_sum: float


def merged_model(model: nn.Module, weight: float) -> nn.Module | None:
    """A copy of ``model`` whose MLP mixtures hold one LoRA expert, the merge of theirs with
    every expert at ``weight``; ``None`` when a mixture holds an expert that is not LoRA."""
    merged = copy.deepcopy(model)
    for site in mixtures(merged):
        experts = list(site.experts.values())
        if not all(isinstance(expert, nn.ModuleDict) for expert in experts):
            return None
        site.experts = nn.ModuleDict({"merged": nn.ModuleDict({
            linear: merged_lora([(expert[linear], weight) for expert in experts]) for linear in experts[0]})})
        site.router = UniformRouter(1)
    return merged


def routed_expert_count(model: nn.Module) -> int:
    """The most experts any MLP mixture of ``model`` routes between (0 without mixtures)."""
    return max((len(site.experts) for site in mixtures(model)), default=0)


@torch.no_grad()
def mixture_gap(model: nn.Module, blocks: torch.Tensor, batch_size: int) -> MixtureGap | None:
    """The routed ``model`` against its experts averaged and summed, on token ``blocks``;
    ``None`` when nothing is routed (one expert per site) or an expert is not LoRA."""
    experts = routed_expert_count(model)
    if experts < 2:
        return None
    averaged, summed = merged_model(model, 1.0 / experts), merged_model(model, 1.0)
    if averaged is None or summed is None:
        return None
    models = {"routed": model, "average": averaged, "sum": summed}
    device = next(model.parameters()).device
    gaps = {"average": 0.0, "sum": 0.0}
    for batch in blocks.split(batch_size):
        routed = model(input_ids=batch.to(device)).logits.float()
        for name in gaps:
            gaps[name] += float((routed - models[name](input_ids=batch.to(device)).logits.float()).abs().sum())
    values = blocks.shape[0] * blocks.shape[1] * routed.shape[-1]
    context = blocks.shape[1]
    ppl = {name: perplexity_of(block_nll(m, blocks, batch_size), context) for name, m in models.items()}
    return MixtureGap(
        blocks=int(blocks.shape[0]), experts=experts,
        logit_gap_average=gaps["average"] / values, logit_gap_sum=gaps["sum"] / values,
        perplexity_routed=ppl["routed"], perplexity_average=ppl["average"], perplexity_sum=ppl["sum"],
    )
