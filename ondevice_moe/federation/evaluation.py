"""How a device scores its model: test perplexity for language modelling
(in distribution on its own test split, out of distribution on the union of all
users' test splits — CoMiGS Table 2, one split per domain under ``data.clients``; FDLoRA
first fits its fusion weight on the validation split), the task metric for classification
(Hermes Table 1); and FedSoft's and IFCA's centres on each source's own test set
(FedSoft Tables 1 and 3); FedEM's mixture prediction beside its centre of largest π; Flow's Acc_g,
Acc_p and per-instance breakdown (Flow eq. 6–7).
Used by the ClientApp every round and by ``ondevice-moe eval``."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.likelihood import block_nll, nll_standard_error, perplexity_of
from ondevice_moe.methods.fedsoft.prediction import CentreMixture
from ondevice_moe.methods.flow.metrics import flow_scores, on_both_paths
from ondevice_moe.metrics import LOWER_IS_BETTER, task_score
from ondevice_moe.report import MIXTURE_SUFFIX
from ondevice_moe.routing.fusion import FUSION_BLOCKS, fit_fusion
from ondevice_moe.training import predict


def evaluate_device(job: Job, device: int, model: nn.Module) -> dict[str, float]:
    """``user_<i>/<value>`` entries for the users this device holds, plus ``num-examples``."""
    if job.recipe.is_language_modelling:
        return _language_model(job, device, model)
    return _classifier(job, device, model)


def user_values(metrics: dict[str, float], user: int) -> dict[str, float]:
    """The ``user_<user>/<value>`` entries of a device's metrics, keyed by ``<value>``."""
    prefix = f"user_{user}/"
    return {key.removeprefix(prefix): value for key, value in metrics.items() if key.startswith(prefix)}


def union_test_nll(job: Job, model: nn.Module) -> tuple[torch.Tensor, list[int], int]:
    """Summed NLL of every block of the union of the users' test splits; user ``u``'s own
    blocks are ``[offsets[u], offsets[u + 1])``; and the blocks' length. Under ``data.clients``
    the union is of the domains' test splits, one device's each (:func:`.device.domain_users`)."""
    per_user = [dev.eval_blocks(job, u) for u in dev.domain_users(job)]
    union_nll = block_nll(model, torch.cat(per_user), job.recipe.data.eval_batch_size)
    offsets = torch.tensor([0, *(b.shape[0] for b in per_user)]).cumsum(0).tolist()
    return union_nll, offsets, per_user[0].shape[1]


def _language_model(job: Job, device: int, model: nn.Module) -> dict[str, float]:
    flow = job.method.procedure.flow
    if flow is not None:  # Flow, FedAvgFT: the personalised and the global model (eq. 6-7 in perplexity)
        tested = dev.adapted_for_test(job, device, model)
        return on_both_paths(tested, flow, lambda: _perplexities(job, device, tested))
    return _perplexities(job, device, model)


def _perplexities(job: Job, device: int, model: nn.Module) -> dict[str, float]:
    batch = job.recipe.data.eval_batch_size
    fused = None
    if job.method.procedure.experts_in_turn:  # FDLoRA: weigh global and personal modules first
        fused = fit_fusion(model, dev.device_split(job, device, "valid")[:FUSION_BLOCKS], batch)
    if job.on_device:  # a real device holds its own data only: no out-of-distribution figure
        own = block_nll(model, dev.eval_blocks(job, device), batch)
        return {"num-examples": int(own.numel()),
                **_user_perplexities(device, own, None, job.recipe.data.context_length, fused)}
    union_nll, offsets, context_length = union_test_nll(job, model)
    metrics: dict[str, float] = {"num-examples": int(union_nll.numel())}
    for user in dev.users_of_device(job, device):
        if user in dev.domain_users(job):
            own = union_nll[offsets[user] : offsets[user + 1]]
        else:  # a further device of a domain (data.clients) is tested on its own sample of it
            own = block_nll(model, dev.eval_blocks(job, user), batch)
        metrics |= _user_perplexities(user, own, union_nll, context_length, fused)
    return metrics


def _user_perplexities(user: int, own: torch.Tensor, union: torch.Tensor | None, context_length: int,
                       fused: float | None) -> dict[str, float]:
    """A user's ``test_ppl_in`` on its own test blocks, ``test_ppl_out`` on the union of every
    user's (when this machine holds them), their standard errors, and FDLoRA's fusion weight."""
    prefix = f"user_{user}/"
    metrics = {prefix + "test_ppl_in": perplexity_of(own, context_length)}
    tested = [("in", own)]
    if union is not None:
        metrics[prefix + "test_ppl_out"] = perplexity_of(union, context_length)
        tested.append(("out", union))
    if fused is not None:
        metrics[prefix + "fusion_global"] = fused
    for side, blocks in tested:
        error = nll_standard_error(blocks, context_length)
        if error is not None:
            metrics[f"{prefix}test_nll_se_{side}"] = error
    return metrics


def _classifier(job: Job, device: int, model: nn.Module) -> dict[str, float]:
    federated = dev.federated_task(job)
    examples = federated.test[device]  # non-empty: build_federated_task checks every client's test share
    task = federated.task
    flow = job.method.procedure.flow
    if flow is not None:  # Flow, FedAvgFT: Acc_p, Acc_g and the per-instance breakdown (eq. 6–7)
        scores = flow_scores(dev.adapted_for_test(job, device, model), flow, examples,
                             job.recipe.task.eval_batch_size)
        return {"num-examples": len(examples), **{f"user_{device}/{k}": v for k, v in scores.items()}}
    predictions = predict(model, examples, job.recipe.task.eval_batch_size, task.is_regression)
    score = task_score(task.metric, predictions.numpy(), examples.labels.numpy())
    return {"num-examples": len(examples), f"user_{device}/score": reported(task.metric, score)}


def mixture_scores(job: Job, device: int, model: nn.Module, centres: dict[int, dict[str, torch.Tensor]],
                   mixture: list[float]) -> dict[str, float]:
    """FedEM's own prediction, the π-mixture of the centres' outputs (:mod:`.prediction`), scored
    as :func:`evaluate_device` scores a model, each per-user key suffixed ``_mixture``
    (``user_0/test_ppl_in_mixture``)."""
    mixed = CentreMixture(copy.deepcopy(model), [centres[s] for s in sorted(centres)], mixture)
    return {f"{key}{MIXTURE_SUFFIX}": value for key, value in evaluate_device(job, device, mixed).items()
            if "/" in key}


def reported(metric: str, score: float) -> float:
    """Fractions (accuracy, F1, MCC, Spearman) are reported ×100; errors (MSE) as they are."""
    return score if metric in LOWER_IS_BETTER else 100.0 * score


def centre_key(centre: int, source: int) -> str:
    """The evaluation key of centre ``centre`` scored on source ``source``'s test set."""
    return f"centre_{centre}_source_{source}"


def scores_every_source(job: Job) -> bool:
    """Whether device 0 can score the centres on every source (:func:`centre_scores`): not on a real device
    when some user's text is the device's own (``source: device``), which no other device may read."""
    return not (job.on_device and job.recipe.data is not None and job.recipe.data.brought_by_devices)


def centre_scores(job: Job, model: nn.Module, centres: dict[int, dict[str, torch.Tensor]]) -> dict[str, float]:
    """Every centre scored on every source's held-out examples (``cluster_test``; a language
    model's sources, :func:`_centre_perplexities`): the S × S
    table of FedSoft Tables 1 and 3, as ``user_0/centre_<s>_source_<j>`` entries (the server
    has no evaluation of its own, so device 0 scores them; they are the server's tensors and
    public held-out sets, not the device's data)."""
    if job.recipe.is_language_modelling:
        return _centre_perplexities(job, model, centres)
    federated = dev.federated_task(job)
    task = federated.task
    scratch = copy.deepcopy(model)
    scores = {}
    for centre, tensors in sorted(centres.items()):
        scratch.load_state_dict(tensors, strict=False)
        for source, examples in enumerate(federated.cluster_test):
            predictions = predict(scratch, examples, job.recipe.task.eval_batch_size, task.is_regression)
            score = task_score(task.metric, predictions.numpy(), examples.labels.numpy())
            scores[f"user_0/{centre_key(centre, source)}"] = reported(task.metric, score)
    return scores


def _centre_perplexities(job: Job, model: nn.Module, centres: dict[int, dict[str, torch.Tensor]]
                         ) -> dict[str, float]:
    """Cluster adapters of a language model: every centre's test perplexity on each source of
    the users' mixtures alone (:func:`.device.source_test_blocks`), as ``user_0/centre_<s>_source_<j>``."""
    scratch = copy.deepcopy(model)
    sources = dev.source_test_blocks(job)
    scores = {}
    for centre, tensors in sorted(centres.items()):
        scratch.load_state_dict(tensors, strict=False)
        for source, (_, blocks) in enumerate(sources):
            nll = block_nll(scratch, blocks, job.recipe.data.eval_batch_size)
            scores[f"user_0/{centre_key(centre, source)}"] = perplexity_of(nll, blocks.shape[1])
    return scores
