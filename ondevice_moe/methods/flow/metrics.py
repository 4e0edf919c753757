"""Flow's measures on a device's test examples (§5, eq. 6–7, Fig. 2).

``score`` is the personalised accuracy ``Acc_p`` (eq. 7: the routed model with the hard
policy; FedAvgFT: the local path), ``score_global`` the generalised accuracy ``Acc_g`` (eq. 6:
every instance on the global layers), both ×100; the per-instance breakdown is the share
(%) of test instances correct by the global model only, the personalised model only, both,
or neither (Fig. 2).
"""

from __future__ import annotations

import torch
from torch import nn

from ondevice_moe.methods.base import FlowProcedure
from ondevice_moe.routing.instance_policy import instance_policy
from ondevice_moe.training import predict

BREAKDOWN = ("global_only", "personal_only", "both_correct", "neither_correct")


def personal_path(procedure: FlowProcedure) -> str:
    """The path of the personalised model: the learned policy (Flow) or the local copies (FedAvgFT)."""
    return "policy" if procedure.policy == "learned" else "local"


def flow_scores(model: nn.Module, procedure: FlowProcedure, examples, batch_size: int) -> dict[str, float]:
    """``score`` (Acc_p), ``score_global`` (Acc_g) and the breakdown, on ``examples``."""
    router = instance_policy(model)
    correct = {}
    for path in ("global", personal_path(procedure)):
        router.path = path
        correct[path] = predict(model, examples, batch_size, regression=False) == examples.labels.long()
    router.path = "policy"
    by_global, by_personal = correct["global"], correct[personal_path(procedure)]
    cases = (by_global & ~by_personal, by_personal & ~by_global, by_global & by_personal, ~by_global & ~by_personal)
    scores = {"score": _percent(by_personal), "score_global": _percent(by_global)}
    scores.update({name: _percent(case) for name, case in zip(BREAKDOWN, cases, strict=True)})
    return scores


def _percent(mask: torch.Tensor) -> float:
    return 100.0 * float(mask.float().mean()) if mask.numel() else 0.0
