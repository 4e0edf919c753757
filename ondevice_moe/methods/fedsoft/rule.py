"""The server side of FedSoft and IFCA: S centres, their messages, eq. (6) and client selection.

The server keeps ``cluster_0 … cluster_{S-1}`` and sends every centre to every
client it asks to train (FedSoft: the proximal term of eq. (4) reads all of them;
Alg. 1 line 4 sends them to all clients every τ rounds to estimate importance).
Each update carries the client's weights over the centres (its ``mixture`` record's ``pi``:
FedSoft's ``u_k``, IFCA's one-hot choice). Then, per centre ``s``:

    v_sk = u_ks n_k / Σ_k' u_k's n_k'                                   (6)

* full participation (``selection_size=None``): ``c_s = Σ_k v_sk w_k`` (§3, after
  Alg. 1; the authors' ``do_selection=False``) — with one-hot weights, IFCA's mean of
  the models of the clients that chose ``s``, by example count;
* selection (Alg. 1 lines 16–18): ``K`` clients drawn with probabilities ``v_sk``,
  without replacement as the authors' ``np.random.choice(…, p=v, replace=False)``,
  and ``c_s = (1/K) Σ_{k ∈ Sel_s} w_k``, a plain mean ("simply averaging them", §3).
  By default every client trains each round and ``Sel_s`` is drawn among the uploads;
  ``selected_train`` draws ``Sel_s`` *before* the round, from the weights and example counts
  each client last reported (kept in the ``importances`` slot), and only ``∪_s Sel_s`` train
  (line 17: "Selected clients download {c_s^t}, then compute and report w_k^{t+1}"). One message
  a round: a client not selected neither trains nor re-estimates its ``u_k``, which Alg. 1 lines
  3–12 have every client do every τ rounds, so the server draws from the ``u_k`` it last heard.
  In round 1, before the server has heard from anyone, every client trains and ``Sel_s`` is drawn
  among the uploads (Alg. 1's t = 0 has every client estimate); a client first heard from later
  trains when asked, counting towards no centre until it is drawn.

FedEM (Marfoq et al., 2021, Alg. 1; ``every_centre``): each client trains and sends every
centre (``cluster_<s>/<name>``), and centre ``s`` becomes ``Σ_k (n_k / n) w_ks``, the mean
of the clients' copies of it by example count — eq. (6) with ``u_ks = 1``.

The denominator of eq. (6) runs over the clients that reported this round (the
printed ``Sel_s^t`` would make the weights depend on the selection they define; the
authors' code normalises over all clients). Selection draws from a generator seeded
by the recipe's seed, the aggregation count (kept in the ``rounds`` slot) and ``s``,
so a run is reproducible. A centre no client contributes to keeps its value.

Cluster adapters (``lora_centres``, a LoRA ``ΔW = B A`` per module). ``factors`` averages ``A``
and ``B`` separately, ``c_s = (Σ_k v_sk B_k)(Σ_k v_sk A_k)``, which is not the average of the
clients' models unless they share one ``A``. ``product`` applies eq. (6) to the model a LoRA
*is*, ``W_0 + scale · B A``: the centre's update is ``ΔW_s = Σ_k v_sk B_k A_k`` (with selection,
the plain mean over ``Sel_s``), refactored to the layout's rank ``r`` by truncated SVD
(:func:`refactor_product`). The rank cap: ``ΔW_s`` has rank up to ``min(K r, d)`` (K clients);
keeping its top ``r`` singular directions is the closest rank-``r`` model in Frobenius norm
(Eckart–Young), exact when the clients' updates span at most ``r`` directions (e.g. one shared
``A``). The factors are put in the gauge nearest the clients' mean ``A`` (``B A`` is unchanged by
``B G⁻¹, G A``), so eq. (4)'s proximal term on ``A`` and ``B`` and an IFCA client that loads a
centre see factors like the ones they trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ondevice_moe.methods.fedsoft.centres import centre_key, cluster_slot, split_centres
from ondevice_moe.server_rules.aggregation import Update, probability_problem, record_values
from ondevice_moe.server_rules.rules import ServerRule, Slots

ROUNDS = "rounds"
IMPORTANCES = "importances"  # per client (its index): the weights over the centres it last sent, then n_k
WEIGHTS_RECORD = "mixture"  # a client's weights over the centres travel as this record's "pi"


def centre_weights(update: Update) -> list[float]:
    """The client's weights over the centres (FedSoft's ``u_k``, IFCA's one-hot choice), or none."""
    return record_values(update, WEIGHTS_RECORD, "pi")


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


def _aggregated_rounds(slots: Slots) -> int:
    """How many rounds the centres have been aggregated (the ``rounds`` slot)."""
    return int(slots.get(ROUNDS, {}).get("count", torch.zeros(1)).item())


def mean_model(models: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """``Σ_i weights[i] · models[i]``, tensor by tensor, in float."""
    return {name: sum(float(w) * model[name].float() for w, model in zip(weights, models, strict=True))
            for name in models[0]}


LORA_A, LORA_B = "lora_A", "lora_B"


def lora_pairs(names) -> list[tuple[str, str]]:
    """``(A name, B name)`` of every LoRA module among ``names`` (``….lora_A`` beside ``….lora_B``)."""
    names = set(names)
    return [(name, name.removesuffix(LORA_A) + LORA_B) for name in sorted(names)
            if name.endswith(LORA_A) and name.removesuffix(LORA_A) + LORA_B in names]


def refactor_product(ups: torch.Tensor, downs: torch.Tensor, reference: torch.Tensor,
                     rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, A)`` of rank ``rank`` with ``B A`` the truncated SVD of ``ΔW = ups @ downs``.

    ``ups`` is ``[v_1 B_1, …, v_K B_K]`` (``d_out × K r``) and ``downs`` ``[A_1; …; A_K]``
    (``K r × d_in``), so ``ΔW = Σ_k v_k B_k A_k`` (eq. 6 on the LoRA's update) is never formed:
    with ``ups = Q_u R_u`` and ``downsᵀ = Q_d R_d``, ``ΔW = Q_u (R_u R_dᵀ) Q_dᵀ`` and the SVD of the
    ``K r × K r`` core gives ``ΔW``'s. Of the factorisations ``B = U_r S_r M⁻¹``, ``A = M V_rᵀ``
    the one with ``A`` nearest ``reference`` (the clients' mean ``A``) is taken, ``M = reference
    V_r``; where that ``M`` is ill-conditioned, the balanced ``B = U_r S_r^½``, ``A = S_r^½ V_rᵀ``."""
    q_up, r_up = torch.linalg.qr(ups.double())
    q_down, r_down = torch.linalg.qr(downs.double().T)
    u_core, singular, vh_core = torch.linalg.svd(r_up @ r_down.T)
    kept = min(rank, singular.numel())
    u = q_up @ u_core[:, :kept]
    v = q_down @ vh_core[:kept].T
    s = singular[:kept]
    gauge = reference.double() @ v
    if kept == rank and s.min() > 0 and torch.linalg.cond(gauge) < 1e6:
        up, down = (u * s) @ torch.linalg.inv(gauge), gauge @ v.T
    else:
        root = s.sqrt()
        up, down = u * root, root[:, None] * v.T
    if kept < rank:  # fewer directions than the rank (tiny modules): pad with zeros
        up = torch.cat([up, up.new_zeros(up.shape[0], rank - kept)], dim=1)
        down = torch.cat([down, down.new_zeros(rank - kept, down.shape[1])])
    return up.float(), down.float()


def product_mean(models: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """Eq. (6) on the models the LoRAs make: each LoRA's ``(B, A)`` becomes the rank-``r`` truncated
    SVD of ``Σ_i weights[i] B_i A_i`` (:func:`refactor_product`); every other tensor ``Σ_i weights[i] ·
    models[i]`` as :func:`mean_model`."""
    pairs = lora_pairs(models[0])
    in_pairs = {name for pair in pairs for name in pair}
    mean = mean_model([{n: t for n, t in model.items() if n not in in_pairs} for model in models], weights)
    for a_name, b_name in pairs:
        ups = torch.cat([float(w) * model[b_name].double() for w, model in zip(weights, models, strict=True)], dim=1)
        downs = torch.cat([model[a_name].double() for model in models])
        reference = sum(float(w) * model[a_name].double() for w, model in zip(weights, models, strict=True))
        mean[b_name], mean[a_name] = refactor_product(ups, downs, reference, models[0][a_name].shape[0])
    return mean


@dataclass(frozen=True)
class CentreRule(ServerRule):
    """S cluster centres aggregated by eq. (6), with or without Alg. 1's client selection, or
    (``every_centre``) FedEM's average of every client's copy of each centre by example count.
    ``lora_centres``: how cluster adapters are averaged, ``factors`` (``A`` and ``B`` apart) or
    ``product`` (eq. 6 on ``ΔW = B A``, refactored to rank ``r``; module docstring)."""

    clusters: int = 2
    selection_size: int | None = None
    seed: int = 0
    every_centre: bool = False
    lora_centres: Literal["factors", "product"] = "factors"
    selected_train: bool = False

    @property
    def needs_each_update(self) -> str:
        return ("FedSoft and IFCA select devices per centre and weigh each device's model by its importance u_k "
                "per centre, which needs every device's model")

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

    def devices_to_train(self, slots: Slots, sampled: list[int]) -> list[int]:
        """With ``selected_train``, the sampled clients some centre drew for this round (Alg. 1 line 16),
        and those not heard from yet; else every sampled client."""
        selection = self._selection_before_round(slots)
        if selection is None:
            return sampled
        drawn = set().union(*selection)
        heard = slots.get(IMPORTANCES, {})
        return [device for device in sampled if device in drawn or str(device) not in heard]

    def _selection_before_round(self, slots: Slots) -> list[set[int]] | None:
        """Per centre, ``Sel_s``: K clients drawn with probabilities ``v_sk`` (eq. 6) from the weights and
        counts the clients last reported, by a generator of the recipe seed, the round and ``s``; ``None``
        without ``selected_train`` or before any client has reported."""
        heard = slots.get(IMPORTANCES, {})
        if not self.selected_train or not heard:
            return None
        devices = sorted(int(device) for device in heard)
        reported = np.array([heard[str(device)].tolist() for device in devices], dtype=float)
        weights = aggregation_weights(reported[:, :-1], reported[:, -1])
        done = _aggregated_rounds(slots)
        draws = (select_clients(row, self.selection_size, np.random.default_rng([self.seed, done, s]))
                 for s, row in enumerate(weights))
        return [{devices[i] for i in drawn} for drawn in draws]

    def aggregate(self, slots: Slots, updates: list[Update]) -> Slots:
        """Fold the updates into the centres; an update without S finite, non-negative weights
        over the centres (a malformed ``mixture`` record) counts towards none of them."""
        updates = [update for update in updates if update.tensors and self._weighs_centres(centre_weights(update))]
        if not updates:
            return slots
        selection = self._selection_before_round(slots)  # the draw that chose who trained: the slots are unchanged
        done = _aggregated_rounds(slots)
        importance = np.array([centre_weights(update) for update in updates], dtype=float)
        if self.every_centre:
            importance = np.ones_like(importance)
        examples = np.array([update.num_examples for update in updates], dtype=float)
        weights = aggregation_weights(importance, examples)
        fresh = dict(slots)
        for centre, row in enumerate(weights):
            if not row.any():
                continue
            if selection is None:
                models, coefficients = self._contributions(updates, row, done, centre)
            else:  # line 18: the plain mean of the drawn clients' models that arrived
                models = [update.tensors for update in updates if update.device in selection[centre]]
                coefficients = [1.0 / len(models)] * len(models)
            if not models:
                continue
            combine = product_mean if self.lora_centres == "product" else mean_model
            fresh[cluster_slot(centre)] = combine(models, coefficients)
        fresh[ROUNDS] = {"count": torch.tensor([done + 1])}
        if self.selected_train:
            fresh[IMPORTANCES] = {**slots.get(IMPORTANCES, {}), **{
                str(update.device): torch.tensor([*centre_weights(update), update.num_examples], dtype=torch.float64)
                for update in updates}}
        return fresh

    def check_records(self, update: Update) -> str | None:
        """The weights over the centres, where sent, are a probability vector."""
        weights = centre_weights(update)
        problem = probability_problem(weights, "weighting of the centres") if weights else None
        return None if problem is None else f"device {update.device} {problem}"

    def _weighs_centres(self, mixture: list[float]) -> bool:
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
