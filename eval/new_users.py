"""A new user who holds one domain picks a cluster centre (FedSoft §5, Tables 1 and 3: centres
"for new users"; issue 9: "a new user with a single domain picks the right centre").

Usage: python eval/new_users.py RUN [RUN ...] [--method METHOD ...]

For every finished FedSoft, IFCA or FedEM method of a language-modelling RUN (cluster adapters;
the centres are read from ``checkpoints/<method>/server.safetensors``), each source of the users'
text plays a new user holding that source alone. Its test blocks — the ones the S × S table
scores — are cut in two halves: the user picks the centre with the lowest NLL on the first half
(the text it has before choosing) and is scored on the second half. A centre no client ever chose
(IFCA) is still on offer, at its starting value, as it is to the clients. Printed per run, method and
source: the centre picked, the perplexity of every centre on the second half, whether the pick is
the second half's best, and the margin of the pick over the next best centre on the second half,
``100·ln(ppl_next / ppl_pick)`` in percent, with its standard error over the blocks (paired: each
block scored by both centres). Then, per method over runs: how often the pick is right, how often
the sources pick different centres (the centres specialise by domain), and the mean margin.

A margin within two standard errors of zero means the centres are interchangeable for that
domain: any pick is "right" by chance.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from centred_runs import centred_jobs, final_centres, over_runs

from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.likelihood import block_nll


@dataclass(frozen=True)
class Pick:
    """One new user's choice: ``ppl[s]`` is centre ``s``'s perplexity on the scored half."""

    source: str
    picked: int
    ppl: list[float]
    margin_pct: float
    margin_se: float

    @property
    def right(self) -> bool:
        return self.picked == min(range(len(self.ppl)), key=self.ppl.__getitem__)


def pick_centre(losses: torch.Tensor, source: str) -> Pick:
    """The pick of a user whose blocks' per-token mean NLLs under each centre are the ``(S, n)``
    ``losses`` (so a gap of 0.01 is a 1 % perplexity gap): chosen on the first ``n // 2`` blocks,
    scored on the rest."""
    half = losses.shape[1] // 2
    if half < 1 or losses.shape[0] < 2:
        raise UserError(f"source {source}: {losses.shape[1]} test blocks and {losses.shape[0]} centres",
                        "a pick needs two centres and at least two test blocks (raise data.test_tokens)")
    picked = int(losses[:, :half].mean(dim=1).argmin())
    scored = losses[:, half:].double()
    ppl = [math.exp(float(row.mean())) for row in scored]
    others = [s for s in range(losses.shape[0]) if s != picked]
    runner_up = min(others, key=lambda s: float(scored[s].mean()))
    gaps = 100 * (scored[runner_up] - scored[picked])
    se = float(gaps.std() / math.sqrt(gaps.numel())) if gaps.numel() > 1 else float("nan")
    return Pick(source, picked, ppl, float(gaps.mean()), se)


def new_user_picks(run: Path, methods: list[str] | None) -> dict[str, list[Pick]]:
    """Every source's pick, per centred method of ``run``."""
    picks = {}
    for job in centred_jobs(run, methods):
        model = dev.build_model(job, 0)
        sources = dev.source_test_blocks(job)
        length = job.recipe.data.context_length
        per_centre = []
        for centre in final_centres(job):
            model.load_state_dict(centre, strict=False)
            per_centre.append([block_nll(model, blocks, job.recipe.data.eval_batch_size) / (length - 1)
                               for _, blocks in sources])
        picks[job.method.name] = [pick_centre(torch.stack([row[j] for row in per_centre]), name)
                                  for j, (name, _) in enumerate(sources)]
    return picks


def _run_table(run: Path, picks: dict[str, list[Pick]]) -> str:
    lines = [f"## {run}", "", "| method | new user's domain | centre picked | ppl of each centre (second half) "
             "| right | margin % (s.e.) |", "|---|---|---|---|---|---|"]
    for method, rows in picks.items():
        for pick in rows:
            cells = ", ".join(f"c_{s} {value:.2f}" for s, value in enumerate(pick.ppl))
            lines.append(f"| {method} | {pick.source} | c_{pick.picked} | {cells} | {'yes' if pick.right else 'no'} "
                         f"| {pick.margin_pct:+.2f} ({pick.margin_se:.2f}) |")
    return "\n".join(lines)


def _summary_table(all_picks: list[dict[str, list[Pick]]]) -> str:
    methods = sorted({method for picks in all_picks for method in picks})
    lines = ["## over runs", "", "| method | runs | picks right | runs whose domains pick different centres "
             "| mean margin % (std over picks) | margins beyond 2 s.e. |", "|---|---|---|---|---|---|"]
    for method in methods:
        runs = [picks[method] for picks in all_picks if method in picks]
        flat = [pick for rows in runs for pick in rows]
        margins = [pick.margin_pct for pick in flat]
        spread = statistics.stdev(margins) if len(margins) > 1 else 0.0
        apart = sum(len({pick.picked for pick in rows}) == len(rows) for rows in runs)
        clear = sum(abs(pick.margin_pct) > 2 * pick.margin_se for pick in flat)
        lines.append(f"| {method} | {len(runs)} | {sum(p.right for p in flat)} of {len(flat)} | {apart} of {len(runs)} "
                     f"| {statistics.fmean(margins):+.2f} ({spread:.2f}) | {clear} of {len(flat)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    studied = over_runs(argv, __doc__.split("\n\n")[0], new_user_picks)
    for run, picks in studied:
        print(_run_table(run, picks), end="\n\n")
    print(_summary_table([picks for _, picks in studied]))


if __name__ == "__main__":
    main()
