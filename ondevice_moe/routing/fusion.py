"""FDLoRA's adaptive fusion (Qi et al., 2024, "FDLoRA: Personalized Federated Learning of
Large Language Model via Dual LoRA Tuning", AdaFusion), the CoMiGS Table 2 baseline.

A device holds a global LoRA module (averaged by the server) and a personal one
(its own), trained each alone in turn. After training, the device picks how much
of each to use from a few validation blocks, without gradients:

    w* = argmin_w  NLL_valid( w · global + (1 − w) · personal ),   w ∈ {0, 0.1, …, 1}

Differences from the paper, which this toolkit's mixture makes necessary or
simpler: FDLoRA (after LoraHub) merges the modules' parameters with free weights
found by Nevergrad under an L1 penalty; here the weights mix the two modules'
MLP outputs (the exact mixture of :mod:`ondevice_moe.mixture`, whose weights sum
to one, which makes the L1 penalty a constant), and the search is a grid.
"""

from __future__ import annotations

import torch
from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.likelihood import block_nll
from ondevice_moe.mixture import MixtureMLP, mixtures
from ondevice_moe.routing.routers import ClientRouter

FUSION_GRID = tuple(step / 10 for step in range(11))
FUSION_BLOCKS = 32  # "few-shot": at most this many validation blocks


def client_level_sites(model: nn.Module) -> list[MixtureMLP]:
    return [site for site in mixtures(model) if isinstance(site.router, ClientRouter)]


def set_fusion(model: nn.Module, first_weight: float) -> None:
    """Every client-level site mixes its two experts with ``(first_weight, 1 − first_weight)``."""
    for site in client_level_sites(model):
        site.router.mix.copy_(torch.tensor([first_weight, 1.0 - first_weight]))


@torch.no_grad()
def fit_fusion(model: nn.Module, blocks: torch.Tensor, batch_size: int) -> float:
    """Set and return the weight of each site's first expert (the layout's first: the
    global module) that gives the lowest NLL on ``blocks``; ties go to the smaller weight."""
    sites = client_level_sites(model)
    if not sites or any(len(site.experts) != 2 for site in sites):
        raise UserError("adaptive fusion needs two experts under a client-level router at every MLP",
                        "use the fdlora method's layout (one global and one personal LoRA module)")
    losses = []
    for weight in FUSION_GRID:
        set_fusion(model, weight)
        losses.append(float(block_nll(model, blocks, batch_size).sum()))
    best = FUSION_GRID[min(range(len(losses)), key=losses.__getitem__)]
    set_fusion(model, best)
    return best
