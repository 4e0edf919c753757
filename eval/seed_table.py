"""Per-method table over several runs (seeds), as in CoMiGS Table 2 and Hermes Table 1.

Usage: python eval/seed_table.py RUN [RUN ...]

Each RUN is a run folder with a ``summary.json``. For every method found in
all runs it prints, over runs, the mean (std) of the users' mean value —
test perplexity in and out of distribution for language modelling, the task
score for classification — its mean std over users, and the upload per round.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def load_summaries(runs: list[Path]) -> list[dict]:
    summaries = []
    for run in runs:
        path = run / "summary.json"
        if not path.is_file():
            raise SystemExit(f"error: {path} does not exist; fix: pass run folders of finished runs")
        summaries.append(json.loads(path.read_text(encoding="utf-8")))
    return summaries


def _spread(values: list[float]) -> str:
    deviation = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.2f} ({deviation:.2f})"


def seed_table(summaries: list[dict]) -> str:
    methods = [m for m in summaries[0]["methods"] if all(m in s["methods"] for s in summaries)]
    language = any("mean_in" in m for m in summaries[0]["methods"].values())
    keys = ["in", "out"] if language else ["score"]
    runs = len(summaries)
    header = ["method", *(f"{k}: mean (std) over {runs} run(s)" for k in keys),
              *(f"{k}: std over users" for k in keys), "upload / round (MiB)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in methods:
        entries = [s["methods"][method] for s in summaries]
        cells = [_spread([e[f"mean_{k}"] for e in entries]) for k in keys]
        cells += [f"{statistics.fmean(e[f'std_{k}'] for e in entries):.2f}" for k in keys]
        cells.append(f"{statistics.fmean(e['upload_bytes_per_round'] for e in entries) / 2**20:.2f}")
        lines.append(f"| {method} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    print(seed_table(load_summaries([Path(a) for a in argv])))


if __name__ == "__main__":
    main(sys.argv[1:])
