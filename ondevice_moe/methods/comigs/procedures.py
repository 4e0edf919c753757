"""The device sides of three CoMiGS baselines that differ from plain local training.

* PCL (:class:`PeerMixing`): a round may start by replacing the device's model with its peers'
  models weighted by trust on its validation split (:mod:`ondevice_moe.server_rules.peers`);
* FDLoRA (:class:`ExpertsInTurn`): each expert step trains one expert of each client-level
  router alone, in turn, and before its test the device fits the weight of its global and
  personal modules on its validation split (:mod:`ondevice_moe.routing.fusion`);
* HetLoRA (:class:`RankSelfPruning`): the rank self-pruning penalty joins the loss, the ranks the
  server cut stay at zero after every step, and modules the server sends at a pruned rank are
  padded back to the device's rank (:mod:`ondevice_moe.server_rules.rank_pruning`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ondevice_moe.methods.procedure import OnDevice, Procedure, Tensors
from ondevice_moe.mixture import mixtures
from ondevice_moe.routing import ClientRouter
from ondevice_moe.routing.fusion import FUSION_BLOCKS, fit_fusion
from ondevice_moe.server_rules.peers import mix_peers, split_peers
from ondevice_moe.server_rules.rank_pruning import fit_received, pruning_penalty, zero_pruned_ranks

if TYPE_CHECKING:
    from ondevice_moe.training import DeviceTrainer


@dataclass(frozen=True)
class PeerMixing(Procedure):
    """PCL: the relayed peers' models are read, not loaded; on a mixing round the device's model
    becomes their trust-weighted average before it trains on."""

    @property
    def loads_received(self) -> bool:
        return False

    def begin_round(self, device: OnDevice, trainer: DeviceTrainer, received: Tensors | None,
                    server_round: int) -> dict[str, float]:
        """``trust_<j>`` per peer, or nothing on a round without relayed models."""
        if not received:
            return {}
        weights = mix_peers(trainer.model, split_peers(received), device.blocks("valid"), device.eval_batch_size)
        return {f"trust_{peer}": weight for peer, weight in weights.items()}


@dataclass(frozen=True)
class ExpertsInTurn(Procedure):
    """FDLoRA: one expert of each client-level site trains alone each step, in turn; the global
    module's weight is fitted on the validation split before the test (``fusion_global``)."""

    def idle_parameters(self, trainer: DeviceTrainer) -> set[int]:
        """Route every token of each client-level site to its expert ``iteration mod n``; the ids of
        the other experts' parameters, which this step leaves untouched (no gradient, so AdamW
        neither moves nor decays them)."""
        idle: set[int] = set()
        for site in mixtures(trainer.model):
            if isinstance(site.router, ClientRouter):
                turn = trainer.iteration % len(site.experts)
                site.router.use_only(turn)
                for index, expert in enumerate(site.experts.values()):
                    if index != turn:
                        idle.update(id(param) for param in expert.parameters())
        return idle

    def evaluate(self, device: OnDevice, model: nn.Module) -> dict[str, float]:
        fused = fit_fusion(model, device.blocks("valid")[:FUSION_BLOCKS], device.eval_batch_size)
        return {**device.score(model), f"user_{device.index}/fusion_global": fused}


@dataclass(frozen=True)
class RankSelfPruning(Procedure):
    """HetLoRA's device side (Cho et al., 2024): ``pruning_lambda`` times the pruning penalty of
    strength ``pruning_strength`` on every expert step, and the cut ranks held at zero."""

    pruning_lambda: float = 0.0
    pruning_strength: float = 0.99

    def loss_terms(self, trainer: DeviceTrainer, *, train_experts: bool, train_router: bool) -> torch.Tensor | None:
        penalty = pruning_penalty(trainer.model, self.pruning_strength) \
            if self.pruning_lambda and train_experts else None
        return None if penalty is None else self.pruning_lambda * penalty

    def after_step(self, trainer: DeviceTrainer) -> None:
        if self.pruning_lambda:
            zero_pruned_ranks(trainer.model)

    def fit_received(self, model: nn.Module, tensors: Tensors) -> Tensors:
        return fit_received(model, tensors)  # modules the server sends at their kept rank
