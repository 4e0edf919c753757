"""A language model's per-block likelihoods: the NLLs behind test perplexity, their
standard error, and the per-block losses FedSoft scores its centres with.

A block scores the tokens its labels name (:class:`~ondevice_moe.data.blocks.BlockExamples`):
every token after the first for a block of text, the response's tokens for an instruction.
Perplexity is exp of the mean NLL over all the scored tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ondevice_moe.data.blocks import IGNORED, BlockExamples
from ondevice_moe.models.devices import model_device


@dataclass(frozen=True)
class BlockLosses:
    """Each block's summed next-token NLL over its scored tokens (``nll``), and how many tokens
    it scored (``tokens``)."""

    nll: torch.Tensor
    tokens: torch.Tensor

    def __len__(self) -> int:
        return int(self.nll.numel())

    def __getitem__(self, rows: slice) -> BlockLosses:
        return BlockLosses(self.nll[rows], self.tokens[rows])

    @property
    def per_token(self) -> torch.Tensor:
        """Each block's mean NLL per scored token."""
        return self.nll / self.tokens

    def perplexity(self) -> float:
        """exp(mean NLL per scored token), over all the blocks' scored tokens."""
        return math.exp(float(self.nll.sum()) / float(self.tokens.sum()))

    def standard_error(self) -> float | None:
        """Standard error of the mean per-token NLL, over the blocks (their per-token means);
        ``None`` for fewer than two blocks.

        A relative perplexity difference δ is a NLL difference of about δ, so a
        1 % perplexity gap is resolved when this is well under 0.01."""
        if len(self) < 2:
            return None
        per_token = self.nll.double() / self.tokens
        return float(per_token.std() / math.sqrt(len(self)))


@torch.no_grad()
def score_blocks(model: nn.Module, blocks: torch.Tensor | BlockExamples, batch_size: int) -> BlockLosses:
    """Each block's summed NLL over its scored tokens and their count (a tensor of token ids is
    blocks of text: every token after the first is scored)."""
    examples = blocks if isinstance(blocks, BlockExamples) else BlockExamples(blocks)
    model.eval()
    device = model_device(model)
    sums, counts = [], []
    for start in range(0, len(examples), batch_size):
        batch = {key: value.to(device) for key, value in examples.batch(slice(start, start + batch_size)).items()}
        targets = batch.pop("labels")[:, 1:]
        logits = model(**batch).logits[:, :-1].float()
        nll = nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none", ignore_index=IGNORED)
        sums.append(nll.sum(dim=1).cpu())
        counts.append((targets != IGNORED).sum(dim=1).cpu())
    return BlockLosses(torch.cat(sums), torch.cat(counts))


def block_nll(model: nn.Module, blocks: torch.Tensor | BlockExamples, batch_size: int) -> torch.Tensor:
    """Summed next-token negative log-likelihood of each block's scored tokens, shape ``(num_blocks,)``."""
    return score_blocks(model, blocks, batch_size).nll


def perplexity_of(nll: torch.Tensor, context_length: int) -> float:
    """exp(mean NLL per predicted token) of blocks of text whose summed NLLs are ``nll``."""
    return _text_blocks(nll, context_length).perplexity()


def nll_standard_error(nll: torch.Tensor, context_length: int) -> float | None:
    """:meth:`BlockLosses.standard_error` of blocks of text whose summed NLLs are ``nll``."""
    return _text_blocks(nll, context_length).standard_error()


def _text_blocks(nll: torch.Tensor, context_length: int) -> BlockLosses:
    """Blocks of text score every token but the first: ``context_length - 1`` each."""
    return BlockLosses(nll, torch.full(nll.shape, context_length - 1, dtype=torch.long))
