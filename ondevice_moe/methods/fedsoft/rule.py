"""The server side of FedSoft and IFCA: S centres, their messages, eq. (6) and client selection.

The server keeps ``cluster_0 … cluster_{S-1}`` and sends every centre to every
client it asks to train (FedSoft: the proximal term of eq. (4) reads all of them;
Alg. 1 line 4 sends them to all clients every τ rounds to estimate importance).
Each update carries the client's weights over the centres (``Update.mixture``:
FedSoft's ``u_k``, IFCA's one-hot choice). Then, per centre ``s``:

    v_sk = u_ks n_k / Σ_k' u_k's n_k'                                   (6)

* full participation (``selection_size=None``): ``c_s = Σ_k v_sk w_k`` (§3, after
  Alg. 1; the authors' ``do_selection=False``) — with one-hot weights, IFCA's mean of
  the models of the clients that chose ``s``, by example count;
* selection (Alg. 1 lines 16–18): ``K`` clients drawn with probabilities ``v_sk``,
  without replacement as the authors' ``np.random.choice(…, p=v, replace=False)``,
  and ``c_s = (1/K) Σ_{k ∈ Sel_s} w_k``, a plain mean ("simply averaging them", §3).

FedEM (Marfoq et al., 2021, Alg. 1; ``every_centre``): each client trains and sends every
centre (``cluster_<s>/<name>``), and centre ``s`` becomes ``Σ_k (n_k / n) w_ks``, the mean
of the clients' copies of it by example count — eq. (6) with ``u_ks = 1``.

The denominator of eq. (6) runs over the clients that reported this round (the
printed ``Sel_s^t`` would make the weights depend on the selection they define; the
authors' code normalises over all clients). Selection draws from a generator seeded
by the recipe's seed, the aggregation count (kept in the ``rounds`` slot) and ``s``,
so a run is reproducible. A centre no client contributes to keeps its value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ondevice_moe.federation.aggregation import Update
from ondevice_moe.federation.rules import ServerRule, Slots
from ondevice_moe.methods.fedsoft.centres import centre_key, cluster_slot, split_centres

ROUNDS = "rounds"


def aggregation_weights(importance: np.ndarray, examples: np.ndarray) -> np.ndarray:
    """Eq. (6): ``(S, N)`` weights ``v_sk`` from ``(N, S)`` importances ``u_ks`` and ``(N,)`` counts ``n_k``;
    a row of zeros for a centre no client weighs (IFCA: nobody chose it)."""
    mass = importance.T * examples[None, :]
    totals = mass.sum(axis=1, keepdims=True)
    return np.divide(mass, totals, out=np.zeros_like(mass), where=totals > 0)


def select_clients(weights: np.ndarray, count: int, generator: np.random.Generator) -> np.ndarray:
    """Alg. 1 line 16: ``count`` distinct client positions drawn in turn with probabilities
    ``weights`` (renormalised over those left), as ``numpy``'s ``choice(replace=False, p=…)``;
    every client with positive weight when fewer have one."""
    count = min(count, int(np.count_nonzero(weights)))
    return np.sort(generator.choice(len(weights), size=count, replace=False, p=weights))


def mean_model(models: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """``Σ_i weights[i] · models[i]``, tensor by tensor, in float."""
    return {name: sum(float(w) * model[name].float() for w, model in zip(weights, models, strict=True))
            for name in models[0]}


@dataclass(frozen=True)
class CentreRule(ServerRule):
    """S cluster centres aggregated by eq. (6), with or without Alg. 1's client selection, or
    (``every_centre``) FedEM's average of every client's copy of each centre by example count."""

    clusters: int = 2
    selection_size: int | None = None
    seed: int = 0
    every_centre: bool = False

    def initial_slots(self) -> Slots:
        return {cluster_slot(s): {} for s in range(self.clusters)}

    def message_for(self, slots: Slots, device: int, train_round: int | None = None) -> dict[str, torch.Tensor]:
        """Every centre the server holds (a client starts the others from their seeds)."""
        return {centre_key(s, name): tensor for s in range(self.clusters)
                for name, tensor in slots[cluster_slot(s)].items()}

    def final_state(self, slots: Slots) -> dict[str, torch.Tensor]:
        """The centres, as they are sent (``cluster_<s>/<name>``): no device keeps them."""
        return self.message_for(slots, 0)

    def reference(self, slots: Slots, device: int) -> dict[str, torch.Tensor]:
        """A client uploads its whole model, shaped like every centre (FedEM: every centre)."""
        return self.message_for(slots, device) if self.every_centre else slots[cluster_slot(0)]

    def aggregate(self, slots: Slots, updates: list[Update]) -> Slots:
        """Fold the updates into the centres; an update without S finite, non-negative weights
        over the centres (a malformed ``mixture`` record) counts towards none of them."""
        updates = [update for update in updates if update.tensors and self._weighs_centres(update.mixture)]
        if not updates:
            return slots
        done = int(slots.get(ROUNDS, {}).get("count", torch.zeros(1)).item())
        importance = np.array([update.mixture for update in updates], dtype=float)
        if self.every_centre:
            importance = np.ones_like(importance)
        examples = np.array([update.num_examples for update in updates], dtype=float)
        weights = aggregation_weights(importance, examples)
        fresh = dict(slots)
        for centre, row in enumerate(weights):
            if not row.any():
                continue
            models, coefficients = self._contributions(updates, row, done, centre)
            fresh[cluster_slot(centre)] = mean_model(models, coefficients)
        fresh[ROUNDS] = {"count": torch.tensor([done + 1])}
        return fresh

    def _weighs_centres(self, mixture: tuple[float, ...]) -> bool:
        return len(mixture) == self.clusters and all(np.isfinite(w) and w >= 0 for w in mixture) and any(mixture)

    def _contributions(self, updates: list[Update], row: np.ndarray, done: int,
                       centre: int) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
        """The models centre ``centre`` is averaged from, and their coefficients."""
        models = [split_centres(u.tensors)[centre] if self.every_centre else u.tensors for u in updates]
        if self.selection_size is None:
            return models, row.tolist()
        generator = np.random.default_rng([self.seed, done, centre])
        chosen = select_clients(row, self.selection_size, generator)
        return [models[i] for i in chosen], [1.0 / len(chosen)] * len(chosen)
