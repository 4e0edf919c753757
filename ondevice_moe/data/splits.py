"""A user's documents → train / valid / test token streams → blocks.

Documents are shuffled with the run's seed and dealt, whole, to the test
split, then validation, then training, until each split holds its token
budget (CoMiGS Table 3 uses 1M / 200k / 200k per user on SlimPajama). No
document is split across two splits, so test text is never seen in training,
unless the documents run out first (a few long documents, or one big file):
then the tails that full splits cut off fill the splits still short.
Each stream is then cut into non-overlapping blocks of the context length.

Instructions (:mod:`~ondevice_moe.data.instruction`) are dealt the same way, whole, each filling
one block (:mod:`~ondevice_moe.data.instruction_blocks`): a split of N tokens holds N //
context_length of them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from itertools import islice

import torch

from ondevice_moe.data.blocks import BlockExamples
from ondevice_moe.data.instruction import Instruction
from ondevice_moe.data.instruction_blocks import instruction_blocks
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
    """One user's examples per split: blocks of token ids, with their labels where not every
    token is its own target (instructions)."""

    name: str
    splits: dict[str, BlockExamples]

    def split(self, name: str) -> torch.Tensor:
        """The ``(num_blocks, context_length)`` token ids of split ``name``."""
        return self.splits[name].blocks

    def examples(self, name: str) -> BlockExamples:
        """Split ``name``'s blocks with their labels and attention masks."""
        return self.splits[name]

    @property
    def train(self) -> torch.Tensor:
        return self.split("train")

    @property
    def valid(self) -> torch.Tensor:
        return self.split("valid")

    @property
    def test(self) -> torch.Tensor:
        return self.split("test")


def split_documents(
    docs: list[str],
    encode,
    eos_id: int,
    budgets: dict[str, int],
    seed: int,
) -> dict[str, list[int]]:
    """Deal shuffled documents to test, valid and train until each budget is met.

    Each document goes whole to one split. The tail that a full split cuts off a document is kept:
    should the documents run out, the tails fill the splits still short (without this, one long
    document filled the test split and left valid and train empty)."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    streams: dict[str, list[int]] = {split: [] for split in SPLITS}
    fill_order = ["test", "valid", "train"]
    current = 0
    cut_off: list[int] = []
    for index in order:
        while current < len(fill_order) and len(streams[fill_order[current]]) >= budgets[fill_order[current]]:
            current += 1
        if current == len(fill_order):
            break
        split = fill_order[current]
        tokens = [*encode(docs[index]), eos_id]
        room = budgets[split] - len(streams[split])
        streams[split].extend(tokens[:room])
        cut_off.extend(tokens[room:])
    for split in fill_order:  # adds nothing unless the documents ran out before every split was full
        room = budgets[split] - len(streams[split])
        streams[split].extend(cut_off[:room])
        del cut_off[:room]
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
    """Build one user's splits from one source or a weighted mixture of sources: the documents'
    blocks, then the instructions' (each source yields one or the other)."""
    total_weight = sum(s.weight for s in sources)
    streams: dict[str, list[int]] = {split: [] for split in SPLITS}
    instructions: dict[str, list[Instruction]] = {split: [] for split in SPLITS}
    for position, source in enumerate(sources):
        share = source.weight / total_weight
        source_budgets = {split: round(budgets[split] * share) for split in SPLITS}
        docs = _read_documents(source, sum(source_budgets.values()))
        if not docs:
            raise UserError(f"user '{name}': source '{source.kind}' yielded no documents", "check the source's options")
        if isinstance(docs[0], Instruction):
            counts = {split: source_budgets[split] // context_length for split in SPLITS}
            dealt = deal_examples(list(dict.fromkeys(docs)), counts, seed + position)
            for split in SPLITS:
                instructions[split].extend(dealt[split])
            continue
        part = split_documents(docs, _encoder(tokenizer), tokenizer.eos_token_id, source_budgets, seed + position)
        for split in SPLITS:
            streams[split].extend(part[split])

    splits = {split: _examples(streams[split], instructions[split], tokenizer, context_length) for split in SPLITS}
    for split in SPLITS:
        if len(splits[split]) == 0:
            raise UserError(
                f"user '{name}' has {len(streams[split])} {split} tokens, fewer than one block of "
                f"data.context_length={context_length}",
                f"give this user more text, raise data.{split}_tokens, or lower data.context_length",
            )
    return UserData(name=name, splits=splits)


def deal_examples(examples: list, counts: dict[str, int], seed: int) -> dict[str, list]:
    """Deal shuffled ``examples`` whole to test, valid and train until each holds its count (the
    training split takes what is left when they run out)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    dealt, start = {}, 0
    for split in ("test", "valid", "train"):
        dealt[split] = [examples[index] for index in order[start : start + counts[split]]]
        start += counts[split]
    return dealt


def _examples(stream: list[int], instructions: list[Instruction], tokenizer, context_length: int) -> BlockExamples:
    """A split's blocks: its documents' token stream cut into blocks, then one block per instruction."""
    blocks = BlockExamples(to_blocks(stream, context_length))
    if not instructions:
        return blocks
    return BlockExamples.concatenate([blocks, instruction_blocks(instructions, tokenizer, context_length)])


def _read_documents(source: SourceSpec, token_budget: int) -> list[str | Instruction]:
    stream = documents(source.kind, source.options)
    if source.kind != "hf":
        return [doc for doc in stream if isinstance(doc, Instruction) or doc.strip()]
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

