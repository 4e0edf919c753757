"""Byzantine-robust aggregation, ``federation.aggregation``: what the server makes of a round's
sound updates before its rule folds them in, so that one lying device cannot set the global model.

* ``mean``: the rule's own weighted mean (default; FedAvg, McMahan et al. 2017).
* ``median``: the coordinate-wise median of the updates (Yin et al. 2018, "Byzantine-robust
  distributed learning"; Flower's ``FedMedian``), unweighted.
* ``trimmed-mean``: per coordinate, drop the ``trim_fraction`` largest and smallest values and
  average the rest (Yin et al. 2018; Flower's ``FedTrimmedAvg``, β = 0.2 by default).
* ``krum``: the one update whose summed squared distance to its ``n − f − 2`` nearest others is
  smallest, ``f`` = ``byzantine`` devices assumed to lie (Blanchard et al. 2017; Flower's ``Krum``).

Each choice hands the rule one update (device ``-1``, one example), so a rule that takes a weighted
mean returns it unchanged, as it does for a SecAgg+ round. A tensor only some devices uploaded
(Hermes-style partial uploads under a plain mean rule) is combined over those devices.
"""

from __future__ import annotations

from typing import Literal

import torch

from ondevice_moe.server_rules.aggregation import Update

Aggregation = Literal["mean", "median", "trimmed-mean", "krum"]


def robust_updates(updates: list[Update], how: Aggregation, trim_fraction: float = 0.2,
                   byzantine: int = 1) -> list[Update]:
    """The updates the rule aggregates under ``how``: all of them for ``mean``, else one combined update."""
    if how == "mean" or not updates:
        return updates
    if how == "krum":
        return [krum(updates, byzantine)]
    combined = {}
    for name in dict.fromkeys(name for update in updates for name in update.tensors):
        values = [update.tensors[name] for update in updates if name in update.tensors]
        stacked = torch.stack([value.detach().double() for value in values])
        result = stacked.median(dim=0).values if how == "median" else trimmed_mean(stacked, trim_fraction)
        if how == "median" and len(values) % 2 == 0:  # the mean of the two middle values, as numpy's median
            ordered = stacked.sort(dim=0).values
            result = (ordered[len(values) // 2 - 1] + ordered[len(values) // 2]) / 2
        combined[name] = result.to(values[0].dtype)
    return [Update(-1, combined, 1)]


def trimmed_mean(stacked: torch.Tensor, trim_fraction: float) -> torch.Tensor:
    """Per coordinate over dim 0: the mean after dropping ``⌊β n⌋`` values from each end."""
    cut = int(trim_fraction * stacked.shape[0])
    ordered = stacked.sort(dim=0).values
    return ordered[cut:stacked.shape[0] - cut].mean(dim=0)


def krum(updates: list[Update], byzantine: int) -> Update:
    """Krum's choice: the update closest to its ``n − f − 2`` nearest neighbours (at least one)."""
    names = sorted(set.intersection(*(set(update.tensors) for update in updates)))
    vectors = torch.stack([torch.cat([update.tensors[name].detach().double().flatten() for name in names])
                           for update in updates])
    distances = torch.cdist(vectors, vectors).pow(2)
    closest = max(1, len(updates) - byzantine - 2)
    scores = [distances[i][torch.arange(len(updates)) != i].sort().values[:closest].sum() for i in range(len(updates))]
    return updates[int(torch.stack(scores).argmin())]
