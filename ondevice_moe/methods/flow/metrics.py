"""Flow's measures on a device's test examples (§5, eq. 6–7, Fig. 2).

``score`` is the personalised accuracy ``Acc_p`` (eq. 7: the routed model with the hard
policy; FedAvgFT: the local path), ``score_global`` the generalised accuracy ``Acc_g`` (eq. 6:
every instance on the global layers), both ×100; the per-instance breakdown is the share
(%) of test instances correct by the global model only, the personalised model only, both,
or neither (Fig. 2).

On a language model the measures are perplexities (:func:`on_both_paths`): ``test_ppl_in`` /
``test_ppl_out`` of the personalised model, ``test_ppl_in_global`` / ``test_ppl_out_global`` of
the global one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ondevice_moe.routing.instance_policy import instance_policy
from ondevice_moe.training import predict

BREAKDOWN = ("global_only", "personal_only", "both_correct", "neither_correct")


def personal_path(policy: str) -> str:
    """The path of the personalised model of a ``policy``: the learned policy (Flow), the
    interpolation (APFL) or the local copies (FedAvgFT, Ditto)."""
    return {"learned": "policy", "apfl": "mixture"}.get(policy, "local")


def flow_scores(model: nn.Module, personal: str, examples, batch_size: int) -> dict[str, float]:
    """``score`` (Acc_p, the model on its ``personal`` path), ``score_global`` (Acc_g) and the
    breakdown, on ``examples``."""
    router = instance_policy(model)
    correct = {}
    for path in ("global", personal):
        router.path = path
        correct[path] = predict(model, examples, batch_size, regression=False) == examples.labels.long()
    router.path = "policy"
    by_global, by_personal = correct["global"], correct[personal]
    cases = (by_global & ~by_personal, by_personal & ~by_global, by_global & by_personal, ~by_global & ~by_personal)
    scores = {"score": _percent(by_personal), "score_global": _percent(by_global)}
    scores.update({name: _percent(case) for name, case in zip(BREAKDOWN, cases, strict=True)})
    return scores


def on_both_paths(model: nn.Module, personal: str, measure: Callable[[], dict[str, float]]) -> dict[str, float]:
    """``measure()`` of the personalised model (on its ``personal`` path), and of the global model
    with ``_global`` after each per-user key (``user_0/test_ppl_in_global``)."""
    router = instance_policy(model)
    try:
        router.path = "global"
        global_ = measure()
        router.path = personal
        personalised = measure()
    finally:
        router.path = "policy"
    return {**personalised, **{f"{key}_global": value for key, value in global_.items() if "/" in key}}


def _percent(mask: torch.Tensor) -> float:
    return 100.0 * float(mask.float().mean()) if mask.numel() else 0.0
