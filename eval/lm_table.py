"""Per-method perplexity table over several runs (seeds), as in CoMiGS Table 2.

Usage: python eval/lm_table.py RUN [RUN ...]

Each RUN is a run folder with a ``summary.json``. For every method found in
all runs, prints the mean over runs of the users' mean test perplexity, in
and out of distribution, with the standard deviation over runs.
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


def seed_table(summaries: list[dict]) -> str:
    methods = [m for m in summaries[0]["methods"] if all(m in s["methods"] for s in summaries)]
    lines = [f"| method | in-dist, mean (std) over {len(summaries)} run(s) | out-of-dist, mean (std) |",
             "|---|---|---|"]
    for method in methods:
        cells = []
        for key in ("mean_in", "mean_out"):
            values = [s["methods"][method][key] for s in summaries]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            cells.append(f"{statistics.fmean(values):.2f} ({spread:.2f})")
        lines.append(f"| {method} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    print(seed_table(load_summaries([Path(a) for a in argv])))


if __name__ == "__main__":
    main(sys.argv[1:])
