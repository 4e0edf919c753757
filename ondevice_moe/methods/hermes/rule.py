"""Hermes' server rule, eq. (10)–(11): each expert of each layer is averaged over the clients
that uploaded it, with weights ω = (h + ε)^(−α), ``h`` the client's usage count of that expert
(α = 1/2, ε = 1), sent as the ``usage`` record (tensor name → tokens routed this round)."""

from __future__ import annotations

from dataclasses import dataclass

from ondevice_moe.server_rules.aggregation import Update, Weighting, example_weighting
from ondevice_moe.server_rules.rules import ServerRule

USAGE = "usage"


def inverse_frequency_weighting(alpha: float, epsilon: float, fallback: Weighting) -> Weighting:
    """Hermes eq. (11) for tensors with a usage count; ``fallback`` for the rest (task heads)."""

    def weight(update: Update, name: str) -> float:
        usage = update.records.get(USAGE, {})
        if name in usage:
            return (usage[name] + epsilon) ** (-alpha)
        return fallback(update, name)

    return weight


@dataclass(frozen=True)
class InverseFrequencyRule(ServerRule):
    """Hermes eq. (10)–(11): each expert is averaged over the devices that uploaded
    it with weights ω = (h + ε)^(−α), h the device's usage count of that expert;
    tensors without a count (task heads) follow ``weighting``."""

    alpha: float = 0.5
    epsilon: float = 1.0
    partial_uploads: bool = True

    @property
    def needs_each_update(self) -> str:
        if self.alpha == 0:
            return ("Hermes without aggregation balance averages each expert over the devices that uploaded it, "
                    "and devices upload only the experts they used")
        return ("Hermes's inverse-frequency weights (h + ε)^(−α) differ per expert and per device and need each "
                "device's usage counts, and devices upload only the experts they used")

    def weights(self) -> Weighting:
        return inverse_frequency_weighting(self.alpha, self.epsilon, example_weighting(self.weighting))

    def check_records(self, update: Update) -> str | None:
        """A usage count is a number of tokens: never negative, and only for a tensor the device sent."""
        for name, count in update.records.get(USAGE, {}).items():
            if isinstance(count, list) or count < 0:
                return f"device {update.device} reported a usage count of {count} for {name}"
            if name not in update.tensors:
                return f"device {update.device} reported a usage count for {name}, which it did not send"
        return None
