"""Client-level collaboration through peers' models: PCL (Wagner et al., 2024, "Personalized
Collaborative Fine-Tuning for On-Device Large Language Models", strategy 2), the CoMiGS
Table 2 baseline.

Every device keeps its own model. Now and then each device weighs every peer's model
by how well it predicts the device's validation split and replaces its own model by
the weighted average:

    w_ij = softmax_j(−PPL_i(θ_j)),    θ_i ← Σ_j w_ij θ_j

with ``PPL_i(θ_j)`` the perplexity of device ``j``'s model on device ``i``'s
validation split (the CoMiGS authors' ``__trust_weights_ref`` and
``__weighted_average`` in ``collab_run_client_level.py``). The authors mix after
training in 0-indexed epochs ``e > 3`` with ``e`` even, which is at the start of
rounds 6, 8, 10, … here (``first_mix=6, every=2``).

In a federation the validation split never leaves its device, so the server
cannot weigh: :class:`PeerRelayRule` keeps each device's latest upload and, at the
start of a mixing round, relays every peer's model to every device;
:func:`mix_peers` computes the trust weights and the average on the device. On
other rounds a device is sent nothing and trains on from the model it kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ondevice_moe.likelihood import block_nll, perplexity_of
from ondevice_moe.server_rules.aggregation import Update
from ondevice_moe.server_rules.rules import ServerRule, Slots

PEER_PREFIX = "peer_"


def device_slot(device: int) -> str:
    return f"device_{device}"


def peer_key(peer: int, name: str) -> str:
    """A relayed tensor's name: ``peer_<j>.<name>``."""
    return f"{PEER_PREFIX}{peer}.{name}"


@dataclass(frozen=True)
class PeerRelayRule(ServerRule):
    """The server side of PCL: one slot per device (its latest upload), all of them relayed
    to every device at the start of rounds ``first_mix, first_mix + every, …``."""

    first_mix: int = 6
    every: int = 2

    @property
    def needs_each_update(self) -> str:
        return "PCL relays each device's own model to its peers, which is what SecAgg+ hides"

    def initial_slots(self) -> Slots:
        return {}

    def mixes(self, train_round: int | None) -> bool:
        """Whether devices mix their peers' models at the start of training round ``train_round``."""
        return train_round is not None and train_round >= self.first_mix and \
            (train_round - self.first_mix) % self.every == 0

    def message_for(self, slots: Slots, device: int, train_round: int | None = None) -> dict[str, torch.Tensor]:
        if not self.mixes(train_round):
            return {}
        return {peer_key(int(slot.removeprefix("device_")), name): tensor
                for slot, tensors in sorted(slots.items()) for name, tensor in tensors.items()}

    def reference(self, slots: Slots, device: int) -> dict[str, torch.Tensor]:
        return slots.get(device_slot(device), {})

    def aggregate(self, slots: Slots, updates: list[Update]) -> Slots:
        fresh = {device_slot(update.device): {**slots.get(device_slot(update.device), {}), **update.tensors}
                 for update in updates if update.tensors}
        return {**slots, **fresh}


def split_peers(tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Relayed tensors by peer: ``{j: {name: tensor}}`` from ``peer_<j>.<name>`` keys."""
    peers: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        peer, name = key.removeprefix(PEER_PREFIX).split(".", 1)
        peers.setdefault(int(peer), {})[name] = tensor
    return peers


def trust_weights(perplexities: torch.Tensor) -> torch.Tensor:
    """PCL strategy 2: ``softmax(−PPL)`` over the peers (perplexities, not losses, as the authors)."""
    return torch.softmax(-perplexities.double(), dim=0).float()


def mix_peers(model: nn.Module, peers: dict[int, dict[str, torch.Tensor]], valid_blocks: torch.Tensor,
              batch_size: int) -> dict[int, float]:
    """Load ``Σ_j w_j θ_j`` into ``model``, ``w`` the trust weights of the peers' models on
    ``valid_blocks``; returns ``{j: w_j}``."""
    order = sorted(peers)
    context_length = valid_blocks.shape[1]
    perplexities = []
    for peer in order:
        model.load_state_dict(peers[peer], strict=False)
        perplexities.append(perplexity_of(block_nll(model, valid_blocks, batch_size), context_length))
    weights = trust_weights(torch.tensor(perplexities))
    names = peers[order[0]].keys()
    mixed = {name: sum(float(w) * peers[peer][name].float() for w, peer in zip(weights, order, strict=True))
             for name in names}
    model.load_state_dict(mixed, strict=False)
    model.train()
    return {peer: float(w) for peer, w in zip(order, weights, strict=True)}
