"""(ε, δ) of the recipe's ``privacy``: what a device's uploads, clipped and noised on the device
(:mod:`ondevice_moe.federation.privacy`), can reveal of its data, accounted by Google's
``dp-accounting`` under Rényi differential privacy (Mironov 2017, "Rényi Differential Privacy").

Each round a device takes part in, it uploads its update clipped to L2 norm C plus Gaussian noise
of std z·C: the Gaussian mechanism with noise multiplier z (Abadi et al. 2016). Neighbouring
inputs differ in one device's data, replaced by none, so that its update is zero (the "zero-out"
relation, Kairouz et al. 2021, "Practical and Private (Deep) Learning without Sampling or
Shuffling", Def. 1.1): the clipped update then moves by at most C. ``RdpAccountant`` composes the
device's uploads and converts their Rényi divergences into ε at the recipe's ``privacy.delta``.

The guarantee is user-level and local: each upload is noised before it leaves the device, so all
that is computed from it (the server's aggregates, with SecAgg+ or without, the models other
devices receive) is post-processing. It holds against anyone who cannot reproduce the noise,
which is seeded by (recipe seed, device, round): not against a server that holds the recipe.
Sampling buys no amplification: the server draws each round's devices and knows who took part,
and a device left out of a round also leaves its noise out. So a device is charged for the rounds
it took part in, and a run's ε is that of the device that took part most often.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant


def epsilon(noise_multiplier: float, uploads: int, delta: float) -> float:
    """ε at ``delta`` of one device after ``uploads`` rounds of the Gaussian mechanism with
    ``noise_multiplier``; 0.0 before its first upload, ∞ without noise (clipping alone hides nothing)."""
    if uploads == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    accountant = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_SPECIAL)
    accountant.compose(dp_event.GaussianDpEvent(noise_multiplier), uploads)
    return float(accountant.get_epsilon(delta))


@dataclass
class PrivacyLedger:
    """How often each device has uploaded in one method's run, and the (ε, δ) that spent."""

    noise_multiplier: float
    delta: float
    uploads: Counter[int] = field(default_factory=Counter)

    def record_round(self, devices: Iterable[int]) -> None:
        """Charge the devices sent a round's training message, whether or not their upload arrived."""
        self.uploads.update(devices)

    @property
    def most_uploads(self) -> int:
        """The most rounds any one device has taken part in."""
        return max(self.uploads.values(), default=0)

    def epsilon(self) -> float:
        """ε at :attr:`delta` of the device that took part most often."""
        return epsilon(self.noise_multiplier, self.most_uploads, self.delta)
