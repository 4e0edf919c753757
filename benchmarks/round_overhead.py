"""Round overhead of a recipe's federation: what a round costs beyond the devices' own work.

Runs the recipe (default ``recipes/demo.yaml``: SmolLM2-135M, four clients) as a real Flower
simulation (``ondevice_moe.runner``) and prints, from the ``round`` records of its
``metrics.jsonl``, per method and round:

* **wall**: the round at the server, from sending the first train message to reading the
  last evaluation reply;
* **slowest client**: the largest train + evaluate handler time of one device (each device
  times its own handlers, restoring its model and saving its state included);
* **busiest worker**: the handler time of the worker process that worked longest; a worker
  serves its devices in turn (with ``federation.cpus_per_client: 2`` on a 2-core machine there
  is one worker), so it is the slowest client where every client has its own worker;
* **overhead** = (wall − busiest worker) ÷ wall: messaging, serialisation, Flower's and Ray's
  waits (goal: ≤ 10 %).

Usage:
    python benchmarks/round_overhead.py [--recipe recipes/demo.yaml] [--rounds R] [--iterations I]
        [--methods "{name: comigs, variant: 1G1S}" ...] [--set key=value ...]
        [--output runs/round-overhead-benchmark]

``--methods`` defaults to the recipe's own. The run goes into ``<output>/run`` (an interrupted
benchmark resumes). Writes ``round_overhead.json`` and ``.md`` under ``--output``; prints the
table, then (last line) the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import simulations

from ondevice_moe.report import MetricsLog

GOAL = 0.10
LABEL = "run"


def options(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = simulations.parser(__doc__, "round-overhead-benchmark")
    parser.add_argument("--methods", nargs="+", help="method entries, as in a recipe (default: the recipe's)")
    return parser.parse_args(argv)


def figures_of(records: list[dict]) -> dict[str, object]:
    """Each method's ``round`` records, and per method the mean and largest overhead."""
    rounds: dict[str, list[dict]] = {}
    for record in records:
        if record["kind"] == "round":
            rounds.setdefault(record["method"], []).append(
                {key: record[key] for key in ("round", "wall_s", "slowest_client_s", "busiest_worker_s", "workers",
                                              "overhead")})
    return {"rounds": rounds, "goal": GOAL,
            "mean_overhead": {method: statistics.fmean(r["overhead"] for r in rows) for method, rows in rounds.items()},
            "max_overhead": {method: max(r["overhead"] for r in rows) for method, rows in rounds.items()}}


def table(figures: dict) -> str:
    """The per-round table, then each method's mean and largest overhead against the goal."""
    lines = ["| method | round | wall (s) | slowest client (s) | busiest worker (s) | workers | overhead |",
             "|---|---|---|---|---|---|---|"]
    for method, rows in figures["rounds"].items():
        lines += [f"| {method} | {r['round']} | {r['wall_s']:.2f} | {r['slowest_client_s']:.2f} | "
                  f"{r['busiest_worker_s']:.2f} | {r['workers']} | {100 * r['overhead']:.1f} % |" for r in rows]
    lines.append("")
    for method in figures["rounds"]:
        worst = figures["max_overhead"][method]
        lines.append(f"{method}: mean overhead {100 * figures['mean_overhead'][method]:.1f} %, largest "
                     f"{100 * worst:.1f} % ({'within' if worst <= GOAL else 'over'} the {100 * GOAL:.0f} % goal)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    args = options(argv)
    overrides = [f"methods=[{', '.join(args.methods)}]"] if args.methods else []
    simulations.run_variant(args, LABEL, overrides)
    figures = figures_of(MetricsLog(args.output / LABEL / "metrics.jsonl").read())
    markdown = table(figures)
    return simulations.publish(args.output, "round_overhead", figures, markdown)


if __name__ == "__main__":
    main()
