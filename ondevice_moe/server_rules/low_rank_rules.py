"""Server rules for devices whose LoRA experts have different ranks (CoMiGS Table 1 baselines).

Each device ``k`` holds its MLP LoRA expert at rank ``r_k`` (``ranks[k]``); the
other shared tensors (the attention LoRA, at one rank for all) are averaged as
usual. The heterogeneous pairs are the ``lora_A`` (``r × in``) and ``lora_B``
(``out × r``) matrices under ``.experts.``.

* :class:`HetLoRARule` — HetLoRA (Cho et al., 2024): zero-pad every device's
  ``A`` and ``B`` to the largest rank, sum them with *sparsity weights* (each
  matrix weighted by its Frobenius norm over the sum of the norms, as in the
  CoMiGS authors' ``HetLoraAggregationStrategy``), and send device ``k`` the
  first ``r_k`` ranks. With ``pruning_strength`` γ (rank self-pruning, the
  authors' ``--is_pruning``): before aggregating, a device's module whose last
  ranks ``[⌊γr⌋, r)`` have a smaller ‖A‖·‖B‖ than the server's at the same
  positions is cut to rank ``⌊γr⌋`` for good; the kept ranks live in the
  ``ranks`` slot (device side: :mod:`ondevice_moe.server_rules.rank_pruning`).
* :class:`FlexLoRARule` — FlexLoRA (Bai et al., 2024): average the full updates
  ``ΔW_k = γ_k B_k A_k`` weighted by example counts, take the SVD
  ``ΔW = U Σ Vᵀ``, and send device ``k`` ``A_k = V_{r_k}ᵀ`` and
  ``B_k = U_{r_k} Σ_{r_k} / γ_k`` (Σ on ``B``, as the authors' ``Server._svd``),
  so that ``γ_k B_k A_k`` is the best rank-``r_k`` approximation of ``ΔW``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ondevice_moe.server_rules.aggregation import Update, average
from ondevice_moe.server_rules.rank_pruning import cut_rank
from ondevice_moe.server_rules.rules import GLOBAL, ServerRule, Slots

A, B = "lora_A", "lora_B"


def has_device_rank(name: str) -> bool:
    """Whether a shared tensor is a matrix of a routed LoRA expert, whose rank is the device's."""
    parts = name.split(".")
    return "experts" in parts and parts[-1] in (A, B)


def _split(update: Update) -> tuple[Update, dict[str, torch.Tensor]]:
    """The update without its rank-varying matrices, and those matrices."""
    varying = {name: t for name, t in update.tensors.items() if has_device_rank(name)}
    rest = {name: t for name, t in update.tensors.items() if name not in varying}
    return replace(update, tensors=rest), varying


def _truncate(name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """The first ``rank`` ranks: rows of ``A``, columns of ``B``."""
    return tensor[:rank] if name.endswith(A) else tensor[:, :rank]


@dataclass(frozen=True)
class _HeterogeneousRankRule(ServerRule):
    """What both rules share: one rank per device, the check against what each device is
    sent, and plain averaging of everything but the rank-varying matrices."""

    ranks: tuple[int, ...] = ()

    @property
    def needs_each_update(self) -> str:
        return (f"its server rule {type(self).__name__} combines devices of different LoRA ranks "
                "(zero-padding or SVD of each device's product), not one weighted sum")

    def reference(self, slots: Slots, device: int) -> dict[str, torch.Tensor]:
        return self.message_for(slots, device)

    def aggregate(self, slots: Slots, updates: list[Update]) -> Slots:
        if not any(update.tensors for update in updates):
            return slots
        rests, varying = zip(*(_split(update) for update in updates), strict=True)
        rest = [update for update in rests if update.tensors]
        state = {**slots[GLOBAL], **(average(rest, self.weights()) if rest else {})}
        combined, extra = self._combine(list(varying), updates, slots)
        state.update(combined)
        return {**slots, **extra, GLOBAL: state}

    def _combine(self, varying: list[dict[str, torch.Tensor]], updates: list[Update],
                 slots: Slots) -> tuple[dict[str, torch.Tensor], Slots]:
        """The server's tensors for the rank-varying matrices (``varying[i]`` from ``updates[i]``),
        and any other slots the rule keeps."""
        raise NotImplementedError


RANKS = "ranks"


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0]


@dataclass(frozen=True)
class HetLoRARule(_HeterogeneousRankRule):
    """HetLoRA: zero-padded, sparsity-weighted aggregation; truncation to each device's
    (kept) rank; rank self-pruning with ``pruning_strength`` (``None``: off)."""

    pruning_strength: float | None = None

    def kept_rank(self, slots: Slots, device: int, name: str) -> int:
        """Device ``device``'s rank for the module of tensor ``name``: its rank, or what pruning left."""
        kept = slots.get(RANKS, {}).get(f"{device}.{_module(name)}")
        return self.ranks[device] if kept is None else int(kept)

    def message_for(self, slots: Slots, device: int, train_round: int | None = None) -> dict[str, torch.Tensor]:
        return {name: _truncate(name, t, self.kept_rank(slots, device, name)) if has_device_rank(name) else t
                for name, t in slots[GLOBAL].items()}

    def reference(self, slots: Slots, device: int) -> dict[str, torch.Tensor]:
        """A device uploads its modules at its full rank (pruned ranks as zeros)."""
        rank = self.ranks[device]
        return {name: _truncate(name, t, rank) if has_device_rank(name) else t for name, t in slots[GLOBAL].items()}

    def _prune(self, slots: Slots, update: Update, tensors: dict[str, torch.Tensor]
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The device's matrices at their kept ranks, each module cut to ``⌊γr⌋`` when its last
        ranks weigh less than the server's; the new kept ranks (``ranks`` slot entries)."""
        kept, ranks = {}, {}
        server = slots[GLOBAL]
        for name in sorted(n for n in tensors if n.endswith(A)):
            module, up_name = _module(name), name.removesuffix(A) + B
            rank = self.kept_rank(slots, update.device, name)
            down, up = tensors[name][:rank], tensors[up_name][:, :rank]
            if self.pruning_strength is not None and name in server:
                cut = cut_rank(rank, self.pruning_strength)
                ours = torch.linalg.norm(down[cut:]) * torch.linalg.norm(up[:, cut:])
                theirs = torch.linalg.norm(server[name][cut:rank]) * torch.linalg.norm(server[up_name][:, cut:rank])
                if cut >= 1 and ours < theirs:
                    down, up, rank = down[:cut], up[:, :cut], cut
            kept[name], kept[up_name] = down, up
            ranks[f"{update.device}.{module}"] = torch.tensor([rank])
        return kept, ranks

    def _combine(self, varying: list[dict[str, torch.Tensor]], updates: list[Update],
                 slots: Slots) -> tuple[dict[str, torch.Tensor], Slots]:
        ranks = dict(slots.get(RANKS, {}))
        pruned = []
        for tensors, update in zip(varying, updates, strict=True):
            kept, kept_ranks = self._prune(slots, update, tensors)
            pruned.append(kept)
            ranks.update(kept_ranks)
        return self._sparsity_weighted(pruned), ({RANKS: ranks} if self.pruning_strength is not None else {})

    def _sparsity_weighted(self, varying: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The sparsity-weighted sum, zero-padded to the largest device rank: never to the largest
        rank *kept* this round, which pruning can shrink below what the devices upload."""
        state = {}
        for name in sorted({name for tensors in varying for name in tensors}):
            held = [tensors[name].float() for tensors in varying if name in tensors]
            top = max(self.ranks)
            shape = (top, held[0].shape[1]) if name.endswith(A) else (held[0].shape[0], top)
            norms = [float(torch.linalg.matrix_norm(t)) for t in held]
            weights = [n / sum(norms) for n in norms] if sum(norms) > 0 else [1.0 / len(held)] * len(held)
            summed = torch.zeros(shape)
            for tensor, weight in zip(held, weights, strict=True):
                summed[: tensor.shape[0], : tensor.shape[1]] += weight * tensor
            state[name] = summed
        return state


@dataclass(frozen=True)
class FlexLoRARule(_HeterogeneousRankRule):
    """FlexLoRA: average the full updates ``γ_k B_k A_k``, redistribute by truncated SVD.

    The slot keeps, per module, ``U Σ`` (``<module>.svd_us``) and ``Vᵀ``
    (``<module>.svd_vt``) at the largest rank, so that each message is a slice.
    ``lora_alpha`` and ``rank_stabilised`` give each device's scaling ``γ_k``.
    """

    lora_alpha: float = 16.0
    rank_stabilised: bool = True

    def scaling(self, rank: int) -> float:
        return self.lora_alpha / (math.sqrt(rank) if self.rank_stabilised else rank)

    def message_for(self, slots: Slots, device: int, train_round: int | None = None) -> dict[str, torch.Tensor]:
        rank = self.ranks[device]
        message = {}
        for name, tensor in slots[GLOBAL].items():
            if name.endswith(".svd_us"):
                module = name.removesuffix(".svd_us")
                message[f"{module}.{B}"] = tensor[:, :rank] / self.scaling(rank)
            elif name.endswith(".svd_vt"):
                message[f"{name.removesuffix('.svd_vt')}.{A}"] = tensor[:rank]
            else:
                message[name] = tensor
        return message

    def _combine(self, varying: list[dict[str, torch.Tensor]], updates: list[Update],
                 slots: Slots) -> tuple[dict[str, torch.Tensor], Slots]:
        state = {}
        weights = [float(update.num_examples) for update in updates]
        modules = sorted({name.removesuffix(f".{A}") for tensors in varying for name in tensors if name.endswith(A)})
        for module in modules:
            delta, total = None, 0.0
            for tensors, weight in zip(varying, weights, strict=True):
                if f"{module}.{A}" not in tensors:
                    continue
                down, up = tensors[f"{module}.{A}"].float(), tensors[f"{module}.{B}"].float()
                term = weight * self.scaling(down.shape[0]) * (up @ down)
                delta = term if delta is None else delta + term
                total += weight
            u, s, vt = torch.linalg.svd(delta / total, full_matrices=False)
            top = max(self.ranks)
            state[f"{module}.svd_us"] = u[:, :top] * s[:top]
            state[f"{module}.svd_vt"] = vt[:top]
        return state, {}

