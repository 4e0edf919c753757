"""Server rules: what the server keeps, what each device is sent, how uploads combine.

The server's state is a set of named *slots*, each a dict of tensors: one
``global`` slot for FedAvg-style methods; one per device for PCL
(:mod:`ondevice_moe.server_rules.peers`); ``cluster_0 … cluster_{S-1}`` for
FedSoft and IFCA (:mod:`ondevice_moe.methods.fedsoft.rule`). A rule decides, per device, which tensors it is sent
(:meth:`ServerRule.message_for`) and folds a round's sound updates into the
slots (:meth:`ServerRule.aggregate`). Checking updates, sampling devices,
timeouts and byte counting belong to the strategy, not to the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ondevice_moe.server_rules.aggregation import Update, Weighting, average, example_weighting

Slots = dict[str, dict[str, torch.Tensor]]
GLOBAL = "global"


@dataclass(frozen=True)
class ServerRule:
    """FedAvg of the shared tensors into one ``global`` slot (McMahan et al., 2017).

    ``weighting``: ``uniform`` (CoMiGS Alg. 1: θ^G = (1/N) Σ_i θ_i^G) or
    ``num_examples``. ``partial_uploads``: devices may upload a subset of the
    shared tensors (Hermes uploads only the experts it used); tensors nobody
    uploaded keep their last value.
    """

    weighting: str = "uniform"
    partial_uploads: bool = False

    @property
    def needs_each_update(self) -> str | None:
        """Why this rule must see each device's update on its own, or ``None`` where it needs no more
        than the weighted mean of the same tensors from every device. Secure aggregation (SecAgg+)
        gives the server that mean and nothing else, so it refuses a rule that says why.

        FedAvg's mean needs no more. A subclass combines the uploads its own way, so unless it
        overrides this (with its reason, or ``None`` where its rule is that one weighted mean
        after all), it is taken to need each one."""
        if type(self) is ServerRule:
            return None
        return f"its server rule {type(self).__name__} does not combine the uploads as one weighted mean"

    def initial_slots(self) -> Slots:
        return {GLOBAL: {}}

    def message_for(self, slots: Slots, device: int, train_round: int | None = None) -> dict[str, torch.Tensor]:
        """The tensors device ``device`` is sent at the start of training round ``train_round``
        (``None``: for an evaluation): here, the whole global slot."""
        return slots[GLOBAL]

    def reference(self, slots: Slots, device: int) -> dict[str, torch.Tensor]:
        """The names and shapes an update from ``device`` is checked against."""
        return slots[GLOBAL]

    def devices_to_train(self, slots: Slots, sampled: list[int]) -> list[int]:
        """Of the devices the strategy sampled for a round, the ones this rule asks to train (a rule
        that picks its clients from what it holds, as FedSoft's selection); here all of them."""
        return sampled

    def weights(self) -> Weighting:
        return example_weighting(self.weighting)

    def check_records(self, update: Update) -> str | None:
        """Why the records ``update`` carries (numbers in bounds already) make no sense to this rule, or
        ``None``; the strategy then drops the device's update. FedAvg reads no records."""
        return None

    def final_state(self, slots: Slots) -> dict[str, torch.Tensor]:
        """What the server holds after the last round that no device's checkpoint does (FedSoft's
        centres); here nothing: every device holds the global tensors."""
        return {}

    def aggregate(self, slots: Slots, updates: list[Update]) -> Slots:
        """Fold a round's sound updates into the slots."""
        if not any(update.tensors for update in updates):
            return slots
        return {**slots, GLOBAL: {**slots[GLOBAL], **average(updates, self.weights())}}
