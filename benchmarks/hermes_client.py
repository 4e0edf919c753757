"""Hermes client cost against plain PEFT LoRA, side by side in one run.

Step time and peak memory of one Hermes device step (LoRA, adapter and prefix
experts in every block, top-2 dual-view router, Hermes §4.2 / §5.1) against a
plain HF PEFT LoRA model (rank 8, α 16, on the query and value projections:
the Hermes LoRA expert alone), on the same base model and the same batch
(timing and memory: see ``harness.py``).

Usage:
    python benchmarks/hermes_client.py [--model smollm2-135m] [--dtype float32|bfloat16]
        [--device auto|cpu|cuda] [--batch 4] [--context 128] [--steps 5] [--threads N] [--compile] [--fused]
        [--profile]

Prints a table, then (last line) the figures as one JSON object.
"""

from __future__ import annotations

from collections.abc import Sequence

import harness
from harness import Configuration

from ondevice_moe.layout import attach_layout, sites_of
from ondevice_moe.methods.registry import method_for
from ondevice_moe.training import DeviceTrainer, TrainingConfig

PEER, OURS = "peft-lora", "hermes"


def build(kind: str, base, batch) -> Configuration:
    """A Hermes device on a copy of ``base`` (sharing its weights), or PEFT LoRA on ``base`` itself."""
    if kind == OURS:
        method = method_for("hermes", 4)
        trainer = DeviceTrainer(attach_layout(base, method.layouts[0], seed=0), method, TrainingConfig())
        return harness.trainer_configuration(trainer, batch)
    sites, _ = sites_of(base)
    return harness.peft_lora_configuration(base, sites.routed_lora, batch, rank_stabilised=False)


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    return harness.compare(__doc__, __file__, build, PEER, OURS, argv) or {}


if __name__ == "__main__":
    main()
