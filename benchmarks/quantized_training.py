"""The test-perplexity cost of training on a quantized base, side by side in one run.

Runs the recipe (default ``recipes/demo.yaml``: its own base, bfloat16) with ``--methods``
(default: the pretrained base and CoMiGS-1G1S) once on the recipe's base and once per
``--kinds`` (default ``nf4``) with ``model.quantization: <kind>``, each a real Flower
simulation with the same seed and data, and reports for every method and user the test
perplexity in distribution and its ratio to the same method on the unquantized base
(the ``pretrained`` rows are the cost of quantizing alone, before any training).
The noise of each figure is its test set's: a ratio is called a cost only where the log of
it is larger than the standard error of the unquantized run's mean test NLL (``nll_se_in``).

Usage:
    python benchmarks/quantized_training.py [--recipe recipes/demo.yaml] [--kinds nf4 int8]
        [--methods pretrained "{name: comigs, variant: 1G1S}"] [--rounds R] [--iterations I]
        [--set key=value ...] [--output runs/quantized-training-benchmark]

Writes ``quantized_training.json`` and ``.md`` under ``--output``; prints the table, then
(last line) the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import simulations

REFERENCE = "none"
METHODS = ["pretrained", "{name: comigs, variant: 1G1S}"]


def options(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = simulations.parser(__doc__, "quantized-training-benchmark")
    parser.add_argument("--kinds", nargs="+", default=["nf4"], choices=["nf4", "int8"],
                        help="quantized bases to compare with the recipe's own")
    parser.add_argument("--methods", nargs="+", default=METHODS, help="method entries, as in a recipe")
    return parser.parse_args(argv)


def run_all(args: argparse.Namespace) -> tuple[dict[str, dict], dict[str, float]]:
    """Every variant's summary entries, and each variant's wall time in seconds."""
    entries: dict[str, dict] = {}
    wall: dict[str, float] = {}
    methods = f"methods=[{', '.join(args.methods)}]"
    for kind in [REFERENCE, *args.kinds]:
        start = time.perf_counter()
        entries.update(simulations.run_variant(args, kind, [methods, f"model.quantization={kind}"]))
        wall[kind] = time.perf_counter() - start
    return entries, wall


def figures_of(entries: dict[str, dict], wall: dict[str, float]) -> dict[str, object]:
    """Per method, base and user: test perplexity, its ratio to the unquantized base, and whether
    that ratio is larger than the test set's noise."""
    rows: dict[str, dict[str, dict[str, float | bool]]] = {}
    for name, entry in entries.items():
        method = name.rsplit("/", 1)[0]
        reference = entries[f"{method}/{REFERENCE}"]["per_user"]
        rows[name] = {}
        for user, values in entry["per_user"].items():
            ratio = values["in"] / reference[user]["in"]
            rows[name][user] = {"ppl_in": values["in"], "ratio": ratio,
                                "beyond_noise": abs(math.log(ratio)) > reference[user]["nll_se_in"]}
    return {"rows": rows, "wall_s": wall,
            "mean_ratio": {name: sum(v["ratio"] for v in users.values()) / len(users) for name, users in rows.items()}}


def table(figures: dict) -> str:
    """The figures as a markdown table, one row per method and base; * marks a ratio beyond the noise."""
    users = list(next(iter(figures["rows"].values())))
    lines = ["| method / base | " + " | ".join(f"{user} ppl (ratio)" for user in users) + " | mean ratio |",
             "|---" * (len(users) + 2) + "|"]
    for name, per_user in figures["rows"].items():
        cells = [f"{v['ppl_in']:.2f} ({v['ratio']:.3f}{'*' if v['beyond_noise'] else ''})" for v in per_user.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {figures['mean_ratio'][name]:.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    args = options(argv)
    entries, wall = run_all(args)
    figures = figures_of(entries, wall)
    markdown = table(figures)
    return simulations.publish(args.output, "quantized_training", figures, markdown)


if __name__ == "__main__":
    main()
