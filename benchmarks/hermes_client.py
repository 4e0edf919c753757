"""Hermes client cost against plain PEFT LoRA, side by side in one run.

Step time and peak memory of one Hermes device step (LoRA, adapter and prefix
experts in every block, top-2 dual-view router, Hermes §4.2 / §5.1) against a
plain HF PEFT LoRA model (rank 8, α 16, on the query and value projections:
the Hermes LoRA expert alone), on the same base model and the same batch
(timing and memory: see ``harness.py``).

Usage:
    python benchmarks/hermes_client.py [--model smollm2-135m] [--dtype float32|bfloat16]
        [--device auto|cpu|cuda] [--batch 4] [--context 128] [--steps 5] [--threads N]

Prints a table, then (last line) the figures as one JSON object.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import harness
import torch
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
    argv = list(sys.argv[1:] if argv is None else argv)
    args = harness.parser(__doc__).parse_args(argv)
    device = harness.resolve_device(args.device)
    if args.measure_memory:  # child process
        def build_one() -> Configuration:
            loaded = harness.load(args)
            return build(args.measure_memory, loaded.model, harness.batch_of(args, loaded.model.config.vocab_size,
                                                                              device))

        print(json.dumps(harness.measure_memory(build_one, device)))
        return {}

    memory = harness.memory_in_children(__file__, (PEER, OURS), argv)
    loaded = harness.load(args)
    batch = harness.batch_of(args, loaded.model.config.vocab_size, device)
    configurations = {OURS: build(OURS, loaded.model, batch)}
    configurations[PEER] = build(PEER, loaded.model, batch)  # last: PEFT changes the base in place
    times = harness.interleaved_step_times(configurations, args.steps, device)
    params = {name: c.adapter_params for name, c in configurations.items()}
    ratios = harness.print_comparison(PEER, OURS, times, memory, params)
    figures = {"model": args.model, "dtype": args.dtype, "device": device.type, "batch": args.batch,
               "context": args.context, "steps": args.steps, "threads": torch.get_num_threads(),
               "step_s": times, "memory_mib": memory, "adapter_params": params, **ratios}
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
