"""A CoMiGS-1G1S device on a quantized base against the fp32 base, side by side in one run.

Bases (``--kinds``, default all):

* ``fp32``: float32 weights and compute: the reference;
* ``bf16``: bfloat16 weights and compute (``model.dtype: bfloat16``);
* ``int8``: bitsandbytes LLM.int8 linear layers, float32 elsewhere (``model.quantization: int8``);
* ``nf4``: bitsandbytes NF4 linear layers computing in float32 (``model.quantization: nf4``);
* ``nf4-bf16``: NF4 computing in bfloat16, QLoRA's setting (Dettmers et al. 2023, §3)
  (``model.quantization: nf4`` with ``model.dtype: bfloat16``);
* ``nf4-ckpt``, ``nf4-bf16-ckpt``: the same with activation checkpointing
  (``model.activation_checkpointing: true``): each block replayed in the backward pass.

Every side is one CoMiGS-1G1S expert step on the same batch (the experts are the same;
only the frozen base differs). Reported per side, as a ratio to ``fp32``:

* **weights**: bytes of the base's parameters and buffers (what a device stores);
* **tensor peak**: the peak of live tensors during a step: the base, the experts, their
  optimiser state and the step's activations (``tensor_peak.py`` on the CPU; peak allocated
  memory on CUDA). Goal for ``nf4``: ≤ 0.40;
* **peak RSS** (CPU): the child process's peak resident set (``harness.measure_memory``), which
  adds the Python and torch runtime (the same for every side) and what the allocator keeps;
* **step time**: median of ``--steps`` interleaved steps (``harness.interleaved_step_times``).

Usage:
    python benchmarks/quantization.py [--model smollm2-135m] [--device auto|cpu|cuda]
        [--batch 4] [--context 128] [--steps 5] [--threads N]
        [--kinds fp32 bf16 int8 nf4 nf4-bf16 nf4-ckpt nf4-bf16-ckpt]

Prints a table, then (last line) the figures as one JSON object. The perplexity cost of
training on a quantized base is ``benchmarks/quantized_training.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import harness
import torch
from comigs_client import comigs_trainer
from harness import Configuration
from torch import nn

from ondevice_moe.models import load_base_model
from ondevice_moe.models.checkpointing import enable_activation_checkpointing
from ondevice_moe.models.devices import resolve_device

REFERENCE = "fp32"
BASES = {  # kind: (model.dtype, model.quantization, model.activation_checkpointing)
    "fp32": ("float32", "none", False),
    "bf16": ("bfloat16", "none", False),
    "int8": ("float32", "int8", False),
    "nf4": ("float32", "nf4", False),
    "nf4-bf16": ("bfloat16", "nf4", False),
    "nf4-ckpt": ("float32", "nf4", True),
    "nf4-bf16-ckpt": ("bfloat16", "nf4", True),
}


def options(argv: Sequence[str]) -> argparse.Namespace:
    parser = harness.parser(__doc__)
    parser.add_argument("--kinds", nargs="+", default=list(BASES), choices=list(BASES),
                        help=f"bases to compare ({REFERENCE} is always included)")
    args = parser.parse_args(argv)
    args.kinds = [REFERENCE, *(kind for kind in args.kinds if kind != REFERENCE)]
    return args


def load_base(args: argparse.Namespace, kind: str) -> nn.Module:
    """The frozen base of ``kind`` on the benchmark's device."""
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, quantization, _ = BASES[kind]
    return load_base_model(args.model, dtype, quantization, device=resolve_device(args.device)).model


def weight_mib(model: nn.Module) -> float:
    """Bytes of a model's parameters and buffers, in MiB (bitsandbytes' packed weights as stored)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def device_configuration(args: argparse.Namespace, base: nn.Module, kind: str) -> Configuration:
    """One CoMiGS-1G1S expert step on ``base``, on a fixed random batch, checkpointed as ``kind`` says."""
    device = next(base.parameters()).device
    batch = harness.batch_of(args, base.config.vocab_size, device)
    trainer = comigs_trainer(base, variant="1G1S")
    if BASES[kind][2]:
        enable_activation_checkpointing(trainer.model)
    return harness.trainer_configuration(trainer, batch)


def memory_of(args: argparse.Namespace, kind: str) -> dict[str, float]:
    """In a child process: the peak memory of one side, the runtime (transformers,
    bitsandbytes) imported before the first reading so that it is not counted as the model's."""
    import bitsandbytes  # noqa: F401
    import transformers  # noqa: F401

    device = resolve_device(args.device)
    return harness.measure_memory(lambda: device_configuration(args, load_base(args, kind), kind), device)


def figures_of(args: argparse.Namespace, weights: dict[str, float], times: dict[str, float],
               memory: dict[str, dict[str, float]]) -> dict[str, object]:
    """Every side's figures, and their ratios to the fp32 base."""
    tensor_peak = {kind: m["tensor_peak_mib"] for kind, m in memory.items()}

    def ratios(values: dict[str, float]) -> dict[str, float]:
        return {kind: value / values[REFERENCE] for kind, value in values.items()}

    device = resolve_device(args.device).type
    figures = {
        "model": args.model, "device": device, "batch": args.batch,
        "context": args.context, "steps": args.steps, "threads": torch.get_num_threads(),
        "weights_mib": weights, "tensor_peak_mib": tensor_peak, "step_s": times,
        "weights_ratio": ratios(weights), "tensor_peak_ratio": ratios(tensor_peak), "step_time_ratio": ratios(times),
    }
    if device == "cpu":  # on CUDA the child's peak is the allocator's peak, which is the tensor peak already
        peak_rss = {kind: m["peak_mib"] for kind, m in memory.items()}
        figures |= {"peak_rss_mib": peak_rss, "peak_rss_ratio": ratios(peak_rss)}
    return figures


COLUMNS = [("weights (MiB)", "weights_mib", "weights_ratio", 0), ("tensor peak (MiB)", "tensor_peak_mib",
           "tensor_peak_ratio", 0), ("peak RSS (MiB)", "peak_rss_mib", "peak_rss_ratio", 0),
           ("step time (s)", "step_s", "step_time_ratio", 2)]


def table(figures: dict) -> str:
    """The figures as a markdown table, one row per base, each value with its ratio to fp32
    (the columns the figures hold: peak RSS is a CPU figure)."""
    columns = [column for column in COLUMNS if column[1] in figures]
    lines = ["| base | " + " | ".join(title for title, *_ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for kind in figures["step_s"]:
        cells = [f"{figures[value][kind]:.{digits}f} ({figures[ratio][kind]:.2f}×)"
                 for _, value, ratio, digits in columns]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = options(argv)
    device = resolve_device(args.device)  # a missing GPU is refused before any child starts
    if args.measure_memory:  # child process
        print(json.dumps(memory_of(args, args.measure_memory)))
        return {}
    memory = harness.memory_in_children(__file__, args.kinds, argv)
    bases = {kind: load_base(args, kind) for kind in args.kinds}
    weights = {kind: weight_mib(base) for kind, base in bases.items()}
    configurations = {kind: device_configuration(args, base, kind) for kind, base in bases.items()}
    times = harness.interleaved_step_times(configurations, args.steps, device)
    figures = figures_of(args, weights, times, memory)
    print(table(figures))
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
