"""Compressed transport (``federation.transport``) on a recipe, side by side in one run.

Runs the recipe's data and model (default ``recipes/demo.yaml``) with

* FedAvg (two LoRA modules per site) under ``fp32`` transport: the upload reference;
* CoMiGS-1G1S under ``fp32`` transport: the perplexity reference;
* CoMiGS-1G1S under each of ``--kinds`` (default ``int8 bf16``),

each a real Flower simulation (``ondevice_moe.runner``) with the same seed, and reports

* **upload ratio**: mean bytes uploaded per round (``comm`` records of ``metrics.jsonl``:
  what travelled, scales included) against FedAvg's (goal for int8: ≤ 0.25);
* **perplexity ratio**: each user's in-distribution test perplexity against CoMiGS-1G1S
  under fp32 transport (goal for int8: ≤ 1.01, i.e. at most 1 % worse).

Usage:
    python benchmarks/transport.py [--recipe recipes/demo.yaml] [--rounds R] [--iterations I]
        [--kinds int8 bf16] [--set key=value ...] [--output runs/transport-benchmark]

``--rounds``/``--iterations`` shrink the run (``federation.rounds``/``local_iterations``);
without them the recipe's own sizes are used. Each configuration runs into its own folder
under ``--output``, so an interrupted benchmark resumes. Writes ``transport.json`` and
``transport.md`` there; prints the table, then (last line) the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import simulations

UPLOAD_REFERENCE = "fedavg/fp32"
PPL_REFERENCE = "comigs-1G1S/fp32"
COMIGS = "{name: comigs, variant: 1G1S}"


def options(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = simulations.parser(__doc__, "transport-benchmark")
    parser.add_argument("--kinds", nargs="+", default=["int8", "bf16"], choices=["bf16", "fp16", "int8"],
                        help="transports to compare with fp32")
    return parser.parse_args(argv)


def run_configuration(args: argparse.Namespace, kind: str, methods: str) -> dict[str, dict]:
    """Run ``methods`` under transport ``kind``; ``{"<method>/<kind>": summary entry}``."""
    return simulations.run_variant(args, kind, [f"methods={methods}", f"federation.transport={kind}"])


def figures_of(entries: dict[str, dict]) -> dict[str, object]:
    """Upload bytes per round and per-user perplexities, each as a ratio to its reference."""
    uploads = {name: entry["upload_bytes_per_round"] for name, entry in entries.items()}
    reference = entries[PPL_REFERENCE]["per_user"]
    ppl_ratio = {name: {user: values["in"] / reference[user]["in"] for user, values in entry["per_user"].items()}
                 for name, entry in entries.items() if name.startswith("comigs")}
    return {
        "upload_bytes_per_round": uploads,
        "upload_ratio_vs_fedavg_fp32": {name: size / uploads[UPLOAD_REFERENCE] for name, size in uploads.items()},
        "test_ppl_in": {name: {user: values["in"] for user, values in entry["per_user"].items()}
                        for name, entry in entries.items()},
        "test_ppl_ratio_vs_comigs_fp32": ppl_ratio,
    }


def table(figures: dict) -> str:
    """The figures as a markdown table, one row per configuration."""
    users = list(next(iter(figures["test_ppl_in"].values())))
    lines = ["| configuration | upload / round (bytes) | upload ratio vs FedAvg fp32 | "
             + " | ".join(f"{user} ppl (ratio vs CoMiGS fp32)" for user in users) + " |",
             "|---" * (3 + len(users)) + "|"]
    for name, size in figures["upload_bytes_per_round"].items():
        ratios = figures["test_ppl_ratio_vs_comigs_fp32"].get(name, {})
        cells = [f"{figures['test_ppl_in'][name][user]:.3f}"
                 + (f" ({ratios[user]:.4f})" if user in ratios else "") for user in users]
        lines.append(f"| {name} | {size:.0f} | {figures['upload_ratio_vs_fedavg_fp32'][name]:.4f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    args = options(argv)
    entries = run_configuration(args, "fp32", f"[fedavg, {COMIGS}]")
    for kind in args.kinds:
        entries.update(run_configuration(args, kind, f"[{COMIGS}]"))
    figures = figures_of(entries)
    markdown = table(figures)
    return simulations.publish(args.output, "transport", figures, markdown)


if __name__ == "__main__":
    main()
