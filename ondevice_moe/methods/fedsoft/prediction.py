"""FedEM's own prediction: a client's mixture π of the centres' outputs (Marfoq et al., 2021, §3,
Prop. 3.1: ``p(y | x) = Σ_s π_s p_s(y | x)``).

FedSoft §5 scores a FedEM client by its centre of largest π (``device.local_model_of``); this is the
prediction FedEM itself makes, scored beside it. A classifier or a language model mixes the centres'
predicted distributions, so the wrapper returns ``log Σ_s π_s softmax(logits_s)`` as its logits: the
cross-entropy of those is the mixture's negative log-likelihood, and their argmax its predicted class
(the authors' ``LearnersEnsemble.evaluate_iterator`` sums ``π_s · softmax`` the same way). A regressor
mixes the centres' predictions, ``Σ_s π_s f_s(x)``, the mixture's mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ondevice_moe.example_loss import is_regressor

Tensors = dict[str, torch.Tensor]
MIXTURE_SUFFIX = "_mixture"
"""A per-user score of the mixture's prediction carries this suffix; the report summarises it as a
method ``<method>-mixture`` (:mod:`~ondevice_moe.methods.fedsoft.report`)."""


@dataclass(frozen=True)
class MixtureOutput:
    """What the evaluation reads from a model's forward pass."""

    logits: torch.Tensor


class CentreMixture(nn.Module):
    """``model`` holding each of ``centres`` in turn, its outputs mixed by ``mixture`` (π).
    ``model`` is the wrapper's own: it is left holding the last centre."""

    def __init__(self, model: nn.Module, centres: Sequence[Tensors], mixture: Sequence[float]) -> None:
        super().__init__()
        if len(centres) != len(mixture):
            raise ValueError(f"{len(centres)} centres but {len(mixture)} mixture weights")
        self.model = model
        self.centres = list(centres)
        self.mixture = torch.tensor(mixture, dtype=torch.float32)
        self.regression = is_regressor(model)

    @torch.no_grad()
    def forward(self, **inputs: torch.Tensor) -> MixtureOutput:
        outputs = []
        for centre in self.centres:
            self.model.load_state_dict(centre, strict=False)
            outputs.append(self.model(**inputs).logits.float())
        stacked = torch.stack(outputs)  # (S, *output)
        weights = self.mixture.to(stacked.device).view(-1, *([1] * (stacked.dim() - 1)))
        if self.regression:
            return MixtureOutput((weights * stacked).sum(dim=0))
        return MixtureOutput(torch.logsumexp(weights.log() + stacked.log_softmax(dim=-1), dim=0))
