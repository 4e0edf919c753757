"""A round's evaluation riding on the next round's training messages (``federation.evaluation_rides``).

Flower's round is two exchanges: the server sends every device the aggregated tensors to train on,
then sends them again to evaluate. On real devices each exchange costs four hops of the shared
tensors (server → SuperLink → SuperNode → device process, and back) and a pick-up by a SuperNode
that polls for work (docs/deployment.md, "The round's overhead"). Where round ``r + 1`` trains every
device on exactly the tensors round ``r``'s evaluation would send, one message does both: the device
first evaluates what it received with its state after round ``r`` (what its evaluate handler does),
then trains round ``r + 1`` on it, and its reply carries the evaluation's record beside the update.
The figures are those of two exchanges; round ``r``'s evaluation records are written once round
``r + 1``'s replies are read. The server keeps round ``r`` (:mod:`~ondevice_moe.federation.round_state`)
as soon as it is aggregated; a run continued from it finds no evaluation of round ``r`` in its log and
has it ride on the round it sends again. The last round's evaluation, which
also writes the checkpoints, always has its own exchange, as has any round whose next one samples a
subset of the devices, runs SecAgg+, or sends training tensors that differ from the evaluation's
(PCL's peers on a mixing round).
"""

from __future__ import annotations

import torch

from ondevice_moe.federation.job import Job
from ondevice_moe.server_rules.rules import ServerRule, Slots

EVALUATION = "evaluation"  # a training reply's record of the evaluation that rode on its message
EVALUATE_ROUND = "evaluate-round"  # a training message's config: the round whose evaluation rides on it


def rides(job: Job) -> bool:
    """Whether the job's evaluations ride on training messages: the recipe's choice, else on real devices."""
    chosen = job.recipe.federation.evaluation_rides
    return job.submitted if chosen is None else chosen


def same_message(rule: ServerRule, slots: Slots, device: int, train_round: int) -> bool:
    """Whether ``device`` is sent the same tensors to train round ``train_round`` as to evaluate."""
    train, test = rule.message_for(slots, device, train_round), rule.message_for(slots, device, None)
    return train.keys() == test.keys() and all(
        train[name] is test[name] or torch.equal(train[name], test[name]) for name in train)
