"""How a device scores its model: test perplexity for language modelling (in distribution on
its own test split, out of distribution on the union of all users' test splits — CoMiGS Table 2,
one split per domain under ``data.clients``), the task metric for classification (Hermes Table 1).
A method's procedure may change the model tested and add scores of its own
(:meth:`~ondevice_moe.methods.procedure.Procedure.prepare_test` and ``evaluate``), through
:class:`TestedDevice`. Used by the ClientApp every round and by ``ondevice-moe eval``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import RecordDict
from torch import nn

from ondevice_moe.data.blocks import BlockExamples
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.likelihood import BlockLosses, score_blocks
from ondevice_moe.metrics import LOWER_IS_BETTER, task_score
from ondevice_moe.training import predict


@dataclass
class TestedDevice(dev.JobDevice):
    """A device in a test: the procedure's view of it (:class:`~.device.JobDevice`) that can also score."""

    def score(self, model: nn.Module) -> dict[str, float]:
        return score_device(self.job, self.index, model)

    def test_on(self, model: nn.Module, examples: Any) -> float:
        if self.is_language_modelling:
            return score_blocks(model, examples, self.eval_batch_size).perplexity()
        task = dev.federated_task(self.job).task
        predictions = predict(model, examples, self.eval_batch_size, task.is_regression)
        return reported(task.metric, task_score(task.metric, predictions.numpy(), examples.labels.numpy()))

    def cluster_tests(self) -> list[Any] | None:
        """Each source's held-out examples: not on a real device when some user's text is the device's own
        (``source: device``), which no other device may read."""
        recipe = self.job.recipe
        if self.job.on_device and recipe.data is not None and recipe.data.brought_by_devices:
            return None
        if self.is_language_modelling:
            return [examples for _, examples in dev.source_test_examples(self.job)]
        return list(dev.federated_task(self.job).cluster_test)


def evaluate_device(job: Job, device: int, model: nn.Module, state: RecordDict | None = None) -> dict[str, float]:
    """``user_<i>/<value>`` entries for the users this device holds, plus ``num-examples``: the method's
    test of ``model`` (``state``: what the device keeps between rounds)."""
    tested = TestedDevice(job, device, RecordDict() if state is None else state)
    return job.method.procedure.evaluate(tested, model)


def prepare_test(job: Job, device: int, model: nn.Module, received: dict[str, torch.Tensor] | None,
                 state: RecordDict) -> dict[str, float]:
    """Make ``model`` the one the device is tested with (the method's procedure); its extra scores."""
    return job.method.procedure.prepare_test(TestedDevice(job, device, state), model, received)


def score_device(job: Job, device: int, model: nn.Module) -> dict[str, float]:
    """The plain test of ``model`` on the device's users."""
    if job.recipe.is_language_modelling:
        return _perplexities(job, device, model)
    return _classifier(job, device, model)


def user_values(metrics: dict[str, float], user: int) -> dict[str, float]:
    """The ``user_<user>/<value>`` entries of a device's metrics, keyed by ``<value>``."""
    prefix = f"user_{user}/"
    return {key.removeprefix(prefix): value for key, value in metrics.items() if key.startswith(prefix)}


def union_test_losses(job: Job, model: nn.Module) -> tuple[BlockLosses, list[int]]:
    """The losses of every block of the union of the users' test splits; user ``u``'s own
    blocks are ``[offsets[u], offsets[u + 1])``. Under ``data.clients`` the union is of the
    domains' test splits, one device's each (:func:`.device.domain_users`)."""
    per_user = [dev.eval_examples(job, u) for u in dev.domain_users(job)]
    union = score_blocks(model, BlockExamples.concatenate(per_user), job.recipe.data.eval_batch_size)
    offsets = torch.tensor([0, *(len(examples) for examples in per_user)]).cumsum(0).tolist()
    return union, offsets


def _perplexities(job: Job, device: int, model: nn.Module) -> dict[str, float]:
    batch = job.recipe.data.eval_batch_size
    if job.on_device:  # a real device holds its own data only: no out-of-distribution figure
        own = score_blocks(model, dev.eval_examples(job, device), batch)
        return {"num-examples": len(own), **_user_perplexities(device, own, None)}
    union, offsets = union_test_losses(job, model)
    metrics: dict[str, float] = {"num-examples": len(union)}
    for user in dev.users_of_device(job, device):
        if user in dev.domain_users(job):
            own = union[offsets[user] : offsets[user + 1]]
        else:  # a further device of a domain (data.clients) is tested on its own sample of it
            own = score_blocks(model, dev.eval_examples(job, user), batch)
        metrics |= _user_perplexities(user, own, union)
    return metrics


def _user_perplexities(user: int, own: BlockLosses, union: BlockLosses | None) -> dict[str, float]:
    """A user's ``test_ppl_in`` on its own test blocks, ``test_ppl_out`` on the union of every
    user's (when this machine holds them), and their standard errors."""
    prefix = f"user_{user}/"
    metrics = {prefix + "test_ppl_in": own.perplexity()}
    tested = [("in", own)]
    if union is not None:
        metrics[prefix + "test_ppl_out"] = union.perplexity()
        tested.append(("out", union))
    for side, losses in tested:
        error = losses.standard_error()
        if error is not None:
            metrics[f"{prefix}test_nll_se_{side}"] = error
    return metrics


def _classifier(job: Job, device: int, model: nn.Module) -> dict[str, float]:
    examples = dev.scored_examples(job, device)  # non-empty: build_federated_task checks every client's share
    task = dev.federated_task(job).task
    predictions = predict(model, examples, job.recipe.task.eval_batch_size, task.is_regression)
    score = task_score(task.metric, predictions.numpy(), examples.labels.numpy())
    return {"num-examples": len(examples), f"user_{device}/score": reported(task.metric, score)}


def reported(metric: str, score: float) -> float:
    """Fractions (accuracy, F1, MCC, Spearman) are reported ×100; errors (MSE) as they are."""
    return score if metric in LOWER_IS_BETTER else 100.0 * score
