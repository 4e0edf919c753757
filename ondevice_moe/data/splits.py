"""A user's documents → train / valid / test token streams → blocks.

Documents are shuffled with the run's seed and dealt, whole, to the test
split, then validation, then training, until each split holds its token
budget (CoMiGS Table 3 uses 1M / 200k / 200k per user on SlimPajama). No
document is split across two splits, so test text is never seen in training.
Each stream is then cut into non-overlapping blocks of the context length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from itertools import islice

import torch

from ondevice_moe.data.sources import documents
from ondevice_moe.errors import UserError

SPLITS = ("train", "valid", "test")

# Streams from the hub are unbounded: read about 8 characters per budgeted token.
_CHARS_PER_TOKEN_READ = 8


@dataclass
class SourceSpec:
    """One source of a user's domain; ``weight`` is its share in a mixture."""

    kind: str
    options: dict[str, object] = field(default_factory=dict)
    weight: float = 1.0


@dataclass
class UserData:
    """One user's blocks, each a ``(num_blocks, context_length)`` LongTensor."""

    name: str
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor

    def split(self, name: str) -> torch.Tensor:
        return {"train": self.train, "valid": self.valid, "test": self.test}[name]


def split_documents(
    docs: list[str],
    encode,
    eos_id: int,
    budgets: dict[str, int],
    seed: int,
) -> dict[str, list[int]]:
    """Deal shuffled documents to test, valid and train until each budget is met."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    streams: dict[str, list[int]] = {split: [] for split in SPLITS}
    fill_order = ["test", "valid", "train"]
    current = 0
    for index in order:
        while current < len(fill_order) and len(streams[fill_order[current]]) >= budgets[fill_order[current]]:
            current += 1
        if current == len(fill_order):
            break
        split = fill_order[current]
        tokens = [*encode(docs[index]), eos_id]
        streams[split].extend(tokens[: budgets[split] - len(streams[split])])
    return streams


def to_blocks(stream: list[int], context_length: int) -> torch.Tensor:
    """Cut a token stream into ``len // context_length`` non-overlapping blocks."""
    usable = len(stream) // context_length * context_length
    return torch.tensor(stream[:usable], dtype=torch.long).view(-1, context_length)


def build_user_data(
    name: str,
    sources: list[SourceSpec],
    tokenizer,
    budgets: dict[str, int],
    context_length: int,
    seed: int,
) -> UserData:
    """Build one user's splits from one source or a weighted mixture of sources."""
    total_weight = sum(s.weight for s in sources)
    streams: dict[str, list[int]] = {split: [] for split in SPLITS}
    for position, source in enumerate(sources):
        share = source.weight / total_weight
        source_budgets = {split: round(budgets[split] * share) for split in SPLITS}
        docs = _read_documents(source, sum(source_budgets.values()))
        if not docs:
            raise UserError(f"user '{name}': source '{source.kind}' yielded no documents", "check the source's options")
        part = split_documents(docs, _encoder(tokenizer), tokenizer.eos_token_id, source_budgets, seed + position)
        for split in SPLITS:
            streams[split].extend(part[split])

    blocks = {split: to_blocks(streams[split], context_length) for split in SPLITS}
    for split in SPLITS:
        if blocks[split].shape[0] == 0:
            raise UserError(
                f"user '{name}' has {len(streams[split])} {split} tokens, fewer than one block of "
                f"data.context_length={context_length}",
                f"give this user more text, raise data.{split}_tokens, or lower data.context_length",
            )
    return UserData(name=name, **blocks)


def _read_documents(source: SourceSpec, token_budget: int) -> list[str]:
    stream = documents(source.kind, source.options)
    if source.kind != "hf":
        return [doc for doc in stream if doc.strip()]
    wanted_chars, taken, docs = token_budget * _CHARS_PER_TOKEN_READ, 0, []
    for doc in islice(stream, 10_000_000):
        if doc.strip():
            docs.append(doc)
            taken += len(doc)
        if taken >= wanted_chars:
            break
    return docs


def _encoder(tokenizer):
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return encode


@dataclass(frozen=True)
class BlockExamples:
    """A language model's training blocks as examples: each block is its own target."""

    blocks: torch.Tensor

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def batch(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[rows], "labels": self.blocks[rows]}
