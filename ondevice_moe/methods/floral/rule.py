"""FLoRAL's server rule: Alg. 1 lines 11–12.

The base ``u`` is averaged with weights ``N^k`` (the federation's weighting),
and each expert ``c`` with weights ``π_c^k · N^k``, ``π^k`` being the mixture
client ``k`` sent with its update::

    a_c ← Σ_k π_c^k N^k a_c^k / Σ_k π_c^k N^k

(the authors' ``FloralAvg`` and ``EnsembleAvg`` weigh the same way:
``p(k | c) ∝ p(c | k) p(k)``). An expert's tensors are named after it
(``…shared_<c>…``), so the weight of a tensor follows from its name.
"""

from __future__ import annotations

from dataclasses import dataclass

from ondevice_moe.server_rules.aggregation import (
    Update,
    Weighting,
    example_weighting,
    probability_problem,
    record_values,
)
from ondevice_moe.server_rules.rules import ServerRule

MIXTURE = "mixture"  # the record a device's π travels in (FLoRAL Alg. 1 line 12)


def expert_index(name: str) -> int | None:
    """``c`` for a tensor of shared expert ``shared_<c>``, else ``None``."""
    for part in name.split("."):
        if part.startswith("shared_") and part[len("shared_"):].isdigit():
            return int(part[len("shared_"):])
    return None


def client_pi(update: Update) -> list[float]:
    """The client's π (its ``mixture`` record's ``pi``), or none."""
    return record_values(update, MIXTURE, "pi")


def mixture_weighting(fallback: Weighting) -> Weighting:
    """``π_c^k ×`` the fallback weight for expert ``c``'s tensors; the fallback alone for the rest."""

    def weight(update: Update, name: str) -> float:
        index = expert_index(name)
        pi = client_pi(update)
        if index is None or not pi:
            return fallback(update, name)
        return pi[index] * fallback(update, name)

    return weight


@dataclass(frozen=True)
class MixtureRule(ServerRule):
    """FedAvg of the base by ``N^k``, of each expert ``c`` by ``π_c^k N^k`` (FLoRAL Alg. 1)."""

    weighting: str = "num_examples"

    @property
    def needs_each_update(self) -> str:
        return ("FLoRAL weighs each adaptor by each client's π_c, one weight per device and adaptor, "
                "where SecAgg+ takes one weight per device")

    def weights(self) -> Weighting:
        return mixture_weighting(example_weighting(self.weighting))

    def check_records(self, update: Update) -> str | None:
        """π is a probability vector with a weight for every expert whose tensors the device sent."""
        pi = client_pi(update)
        if not pi:
            return None
        problem = probability_problem(pi, "mixture")
        if problem is not None:
            return f"device {update.device} {problem}"
        experts = [index for index in map(expert_index, update.tensors) if index is not None]
        if experts and max(experts) >= len(pi):
            return f"device {update.device} sent expert {max(experts)}'s tensors with a π over {len(pi)} experts"
        return None
