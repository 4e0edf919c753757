"""Seeded batches of a device's examples: the same batch for the same seed and step, whichever
process serves the device and however often it resumes."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from ondevice_moe.example_loss import Examples

Batch = dict[str, torch.Tensor]


def epoch_sampler(examples, batch_size: int, seed: int) -> tuple[Callable[[int], Batch], int]:
    """``sample(i)``: batch ``i`` of seeded epoch permutations of a client's examples; and the
    number of batches per epoch."""
    per_epoch = max(1, -(-len(examples) // batch_size))

    def sample(index: int) -> Batch:
        epoch, position = divmod(index - 1, per_epoch)
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(
            zlib.crc32(f"{seed}:epoch:{epoch}".encode())))
        return examples.batch(order[position * batch_size : (position + 1) * batch_size])

    return sample, per_epoch


def batch_sampler(examples: Examples, batch_size: int, seed: int, stream: str) -> Callable[[int], Batch]:
    """``sample(i)``: a batch of examples (a language model's blocks) drawn at random with replacement,
    the same for the same ``(seed, stream, i)``."""

    def sample(index: int) -> Batch:
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{stream}:{index}".encode()))
        rows = torch.randint(0, len(examples), (batch_size,), generator=generator)
        return examples.batch(rows)

    return sample
