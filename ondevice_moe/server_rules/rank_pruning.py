"""HetLoRA's rank self-pruning (Cho et al., 2024), as the CoMiGS authors run it for Table 1.

The device side, here: each routed MLP LoRA of rank ``r`` (its kept rank, once
pruned) adds to the local loss

    λ · ‖A[⌊γr⌋:r]‖ · ‖B[:, ⌊γr⌋:r]‖

(``get_pruning_loss`` in the authors' ``models/gating.py``), which pushes its last
ranks towards zero, and ranks the server has cut stay at zero after every step
(``GeneralClient.train``). The server side (:class:`~ondevice_moe.server_rules.low_rank_rules.HetLoRARule`)
cuts a device's rank to ``⌊γr⌋`` when the norm product of its last ranks falls
below the server's at the same positions (``_to_pruned_client_data``) and from
then on sends that device its modules at the kept rank; the device pads them
with zeros back to its full rank (:func:`fit_received`).
"""

from __future__ import annotations

import torch
from torch import nn

from ondevice_moe.experts.lora import LoRA

A, B = "lora_A", "lora_B"


def cut_rank(rank: int, strength: float) -> int:
    """The rank a prune leaves, ``⌊γ·r⌋`` as the authors (``int(pruning_strength * rank)``)."""
    return int(strength * rank)


def routed_loras(model: nn.Module) -> dict[str, LoRA]:
    """The LoRA modules of routed MLP experts (the ones whose rank is the device's), by path."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, LoRA) and "experts" in name.split(".")}


def kept_rank(lora: LoRA) -> int:
    return getattr(lora, "kept_rank", lora.rank)


def pruning_penalty(model: nn.Module, strength: float) -> torch.Tensor | None:
    """``Σ ‖A[⌊γr⌋:r]‖·‖B[:, ⌊γr⌋:r]‖`` over the routed LoRA modules (``None`` without any)."""
    terms = []
    for lora in routed_loras(model).values():
        rank = kept_rank(lora)
        cut = cut_rank(rank, strength)
        terms.append(torch.linalg.norm(lora.lora_A[cut:rank]) * torch.linalg.norm(lora.lora_B[:, cut:rank]))
    return torch.stack(terms).sum() if terms else None


@torch.no_grad()
def zero_pruned_ranks(model: nn.Module) -> None:
    """Hold the ranks the server cut at zero."""
    for lora in routed_loras(model).values():
        rank = kept_rank(lora)
        if rank < lora.rank:
            lora.lora_A[rank:] = 0
            lora.lora_B[:, rank:] = 0


def fit_received(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with routed LoRA matrices sent at a pruned rank zero-padded to the device's
    full rank; each such module remembers its kept rank for this round."""
    fitted = dict(tensors)
    for path, lora in routed_loras(model).items():
        down = tensors.get(f"{path}.{A}")
        if down is None or down.shape[0] == lora.rank:
            continue
        up = tensors[f"{path}.{B}"]
        rank = down.shape[0]
        if not 1 <= rank < lora.rank or up.shape[1] != rank:
            raise ValueError(f"received {path} at rank {rank} (B: {tuple(up.shape)}); "
                             f"this device holds rank {lora.rank}")
        fitted[f"{path}.{A}"] = torch.cat([down, down.new_zeros(lora.rank - rank, down.shape[1])])
        fitted[f"{path}.{B}"] = torch.cat([up, up.new_zeros(up.shape[0], lora.rank - rank)], dim=1)
        lora.kept_rank = rank
    return fitted
