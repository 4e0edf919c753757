"""Server-side aggregation of shared tensors, and the checks that keep one
misbehaving device from spoiling the global model.

CoMiGS Alg. 1 line 498: θ^G = (1/N) Σ_i θ_i^G, the plain mean of the devices'
generalists; ``weighting="num_examples"`` gives the FedAvg weighting of
McMahan et al. (2017) instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Update:
    """The shared tensors one device sent back, with its example count."""

    device: int
    tensors: dict[str, torch.Tensor]
    num_examples: int


def check_update(update: Update, reference: dict[str, torch.Tensor] | None) -> str | None:
    """Why ``update`` must be rejected, or ``None`` when it is sound.

    A sound update has finite values and, once a global state exists, exactly
    the global state's names and shapes.
    """
    if update.num_examples <= 0:
        return f"device {update.device} reported {update.num_examples} training examples"
    for name, tensor in update.tensors.items():
        if not torch.isfinite(tensor).all():
            return f"device {update.device} sent non-finite values in {name}"
    if reference:
        missing, extra = set(reference) - set(update.tensors), set(update.tensors) - set(reference)
        if missing or extra:
            return (f"device {update.device} sent unexpected tensors "
                    f"(missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]})")
        for name, tensor in update.tensors.items():
            if tensor.shape != reference[name].shape:
                expected = tuple(reference[name].shape)
                return f"device {update.device} sent {name} with shape {tuple(tensor.shape)}, expected {expected}"
    return None


def average(updates: list[Update], weighting: str = "uniform") -> dict[str, torch.Tensor]:
    """Average each shared tensor over the devices that hold it.

    A name held by a subset of devices (e.g. CoMiGS-1GXs users with different
    expert counts) is averaged over that subset.
    """
    sums: dict[str, torch.Tensor] = {}
    totals: dict[str, float] = {}
    dtypes: dict[str, torch.dtype] = {}
    for update in updates:
        weight = float(update.num_examples) if weighting == "num_examples" else 1.0
        for name, tensor in update.tensors.items():
            value = tensor.detach().double() * weight
            sums[name] = sums[name] + value if name in sums else value
            totals[name] = totals.get(name, 0.0) + weight
            dtypes[name] = tensor.dtype
    return {name: (sums[name] / totals[name]).to(dtypes[name]) for name in sums}
