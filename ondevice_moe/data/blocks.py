"""A language model's examples: blocks of ``context_length`` tokens, and which tokens count.

Language modelling: every block is its own target (``labels`` and ``attention_mask`` are
``None``, and a batch's labels are its input ids, as they always were). Instruction tuning
(:mod:`~ondevice_moe.data.instruction_blocks`): ``labels`` hold the response's token ids and
:data:`IGNORED` on the prompt and the padding, and ``attention_mask`` is 0 on the padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORED = -100  # the label of a token outside the loss (torch's and transformers' ignore_index)


@dataclass(frozen=True)
class BlockExamples:
    """Blocks of token ids, each a row of ``blocks``, as examples: ``len`` and ``batch(rows)``."""

    blocks: torch.Tensor
    labels: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def targets(self) -> torch.Tensor:
        """Each token's label: its own id, or :data:`IGNORED` where it is outside the loss."""
        return self.blocks if self.labels is None else self.labels

    @property
    def mask(self) -> torch.Tensor:
        """1 on each token the model attends to, 0 on padding."""
        return torch.ones_like(self.blocks) if self.attention_mask is None else self.attention_mask

    def batch(self, rows: torch.Tensor | slice) -> dict[str, torch.Tensor]:
        """The model's inputs and labels for ``rows``."""
        batch = {"input_ids": self.blocks[rows], "labels": self.targets[rows]}
        if self.attention_mask is not None:
            batch["attention_mask"] = self.attention_mask[rows]
        return batch

    def __getitem__(self, rows: slice) -> BlockExamples:
        """The examples of ``rows``, e.g. the first few: ``examples[:8]``."""
        return BlockExamples(self.blocks[rows], None if self.labels is None else self.labels[rows],
                             None if self.attention_mask is None else self.attention_mask[rows])

    @classmethod
    def concatenate(cls, parts: Sequence[BlockExamples]) -> BlockExamples:
        """``parts`` one after the other; plain blocks stay plain unless joined to labelled ones."""
        blocks = torch.cat([part.blocks for part in parts])
        if all(part.labels is None and part.attention_mask is None for part in parts):
            return cls(blocks)
        return cls(blocks, torch.cat([part.targets for part in parts]), torch.cat([part.mask for part in parts]))


__all__ = ["IGNORED", "BlockExamples"]
