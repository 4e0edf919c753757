"""Per-example losses: what FedSoft and IFCA score cluster centres with (each example's
lowest-loss centre), and what FedEM's local steps weigh by its E-step responsibilities.

An example is a row of a batch: a small model's input, a classifier's text, or a language
model's block of tokens (whose loss is the mean next-token loss over the block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

EXAMPLE_WEIGHTS = "example_weights"


def is_regressor(model: nn.Module) -> bool:
    """A small model says so; a Hugging Face classifier with one output regresses."""
    if hasattr(model, "regression"):
        return bool(model.regression)
    return getattr(model.config, "num_labels", 2) == 1


def example_loss(model: nn.Module, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss of each row of a batch, shape ``(batch,)``, differentiable: a language model's
    mean next-token cross-entropy over each block (``logits`` of shape ``(batch, T, vocab)``),
    a regressor's squared error averaged over its outputs, or a classifier's cross-entropy.
    The batch means of these are the models' own losses."""
    logits = logits.float()
    if logits.dim() == 3:
        nll = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
        return nll.mean(dim=1)
    if is_regressor(model):
        return (logits - labels.float().view_as(logits)).pow(2).flatten(1).mean(dim=1)
    return nn.functional.cross_entropy(logits, labels.long(), reduction="none")


class Examples(Protocol):
    """A client's examples: a count, and the batch of some of them by position."""

    def __len__(self) -> int: ...

    def batch(self, rows: torch.Tensor) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class WeightedExamples:
    """``examples`` whose batches also carry each row's weight (``EXAMPLE_WEIGHTS``): the trainer
    then minimises the batch mean of ``weight · loss`` in place of the model's own loss."""

    examples: Examples
    weights: torch.Tensor

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**self.examples.batch(rows), EXAMPLE_WEIGHTS: self.weights[rows].float()}
