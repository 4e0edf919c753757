"""Differential privacy on shared tensors (recipe ``privacy``): fixed clipping and
Gaussian noise of each device's update, on the device, before it is encoded.

The mechanism is DP-FedAvg's (McMahan et al., 2018, "Learning Differentially
Private Recurrent Language Models", Alg. 1; the Gaussian mechanism of Abadi et
al., 2016), applied per device (local DP):

* the **update** of a round is Δ = θ_trained − θ_start over the floating tensors
  that leave the device (shared experts, shared heads): θ_start is what the
  device started the round from, i.e. what it received, or its own starting
  values where the server sent nothing (round 1, PCL, FedSoft). Private experts
  and routers never leave the device, so they are neither clipped nor noised;
* **clipping** (FlatClip, McMahan et al. 2018 §3): Δ ← Δ · min(1, C / ‖Δ‖₂),
  ‖·‖₂ over all uploaded tensors together, C = ``privacy.clip_norm``; an update
  already inside the bound is unchanged. This is what Flower's
  ``flwr.supercore.differential_privacy.compute_clip_model_update`` does inside
  ``fixedclipping_mod`` and ``LocalDpMod`` (``flwr/clientapp/mod/centraldp_mods.py``,
  ``localdp_mod.py``);
* **noise**: Δ ← Δ + N(0, σ² I) with σ = z · C, z = ``privacy.noise_multiplier``:
  the Gaussian mechanism for one device's update of sensitivity C, added on the
  device as ``LocalDpMod`` does. The uniform mean over m devices then carries
  noise of std z·C/√m per coordinate; Flower's *central* DP
  (``DifferentialPrivacyClientSideFixedClipping``) instead trusts the server to
  add std z·C/m once to the mean (``compute_stdv``). Noise is drawn from a
  generator seeded by (recipe seed, device, round), so a rerun repeats it, and
  so whoever holds the recipe (the server too) can regenerate it;
* the device uploads θ_start + Δ, which ``federation.transport`` then encodes.

Why not Flower's mods and wrappers as they are: they act on the reply's single
``ArrayRecord`` *after* our handler has encoded it (int8 values plus ``::scale``
entries, bfloat16 bits as int16), where an update is not a difference of
values; they require the reply's names to equal the received ones, which fails
in round 1 (the server's slot is still empty), for Hermes (a subset of experts
travels), PCL (peers arrive, the own model leaves) and FedSoft (centres arrive);
their noise comes from NumPy's unseeded global generator; and the server-side
wrapper noises every slot of :class:`~ondevice_moe.federation.strategy.SlotStrategy`'s
packed state with one std, which is not the mean of m clipped updates for the
per-device or per-centre slots. So the mechanism is written once here, on
named torch tensors, before encoding, for every method.

The (ε, δ) this buys, and what it covers, are :mod:`ondevice_moe.federation.accountant`'s.
What a device reports besides the shared tensors (losses, example counts, Hermes usage
counts, FLoRAL's π, the pre-clip norm below) travels in the clear, as it does without ``privacy``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping

import torch

from ondevice_moe.recipe import PrivacySection


def noise_std(privacy: PrivacySection) -> float:
    """σ = z · C: the std of the Gaussian noise on each coordinate of one device's update."""
    return privacy.noise_multiplier * privacy.clip_norm


def update_norm(update: Mapping[str, torch.Tensor]) -> float:
    """‖Δ‖₂ over all tensors together (Flower's ``get_norm``), in float64."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in update.values()))


def clip_update(update: Mapping[str, torch.Tensor], clip_norm: float) -> tuple[dict[str, torch.Tensor], float]:
    """``(Δ · min(1, C/‖Δ‖), ‖Δ‖)``: the update in float64, scaled into the ball of radius
    ``clip_norm`` when it lies outside (FlatClip); a zero update stays zero."""
    norm = update_norm(update)
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return {name: t.double() * scale for name, t in update.items()}, norm


def noise_generator(seed: int, device: int, server_round: int) -> torch.Generator:
    """The generator of one device's noise in one round: the same on every rerun."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:privacy:{device}:{server_round}".encode()))


def privatize(start: Mapping[str, torch.Tensor], trained: Mapping[str, torch.Tensor], privacy: PrivacySection,
              generator: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """What the device uploads instead of ``trained``: ``start`` plus the clipped, noised update,
    in ``trained``'s dtypes; and the round's figures for ``metrics.jsonl`` (``update_norm``:
    ‖Δ‖ before clipping; ``clipped``: 1 when it was scaled down). Integer tensors (HetLoRA's
    kept ranks) are state, not values learnt from data: they travel unchanged."""
    values = {name: t for name, t in trained.items() if t.is_floating_point()}
    missing = sorted(set(values) - set(start))
    if missing:
        raise ValueError(f"no starting value to take the update of {missing[:3]} from")
    delta = {name: values[name].detach().cpu().double() - start[name].detach().cpu().double()
             for name in sorted(values)}
    clipped, norm = clip_update(delta, privacy.clip_norm)
    sigma = noise_std(privacy)
    upload = dict(trained)
    for name, change in clipped.items():
        if sigma > 0:
            change = change + torch.randn(change.shape, generator=generator, dtype=torch.float64) * sigma
        upload[name] = (start[name].detach().cpu().double() + change).to(trained[name].dtype)
    return upload, {"update_norm": norm, "clipped": int(norm > privacy.clip_norm)}
