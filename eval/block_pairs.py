"""Two methods of a language-modelling run compared block by block on the same test blocks.

Usage: python eval/block_pairs.py RUN [RUN ...] --method A --against B

Each RUN is a finished run folder holding both methods' checkpoints (e.g. one
per seed). For every run and user, both methods' models score the user's own
test blocks (in distribution) and the union of all users' test blocks (out of
distribution); the gap of a block is the difference of its mean per-token NLL,
×100: about the relative perplexity gap in percent (a 1 % perplexity gap is a
NLL gap of 0.01). The table gives, per run and user, the mean gap over the
blocks and its standard error — paired on the same blocks, so what the blocks
share (their difficulty) cancels, which is what lets one run resolve a 1 % gap
that the unpaired standard error of a user's perplexity (0.1 in NLL on 32
blocks) cannot.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import torch

from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.evaluation import union_test_losses
from ondevice_moe.federation.job import Job
from ondevice_moe.runner import finished_jobs


def per_token_nll(job: Job, device: int) -> tuple[torch.Tensor, list[int]]:
    """Mean NLL per scored token of every union test block under device ``device``'s checkpoint, and the offsets."""
    model = dev.build_model(job, device)
    if job.method.trains:
        dev.load_checkpoint(job, device, model)
    losses, offsets = union_test_losses(job, model)
    return losses.per_token, offsets


def block_gaps(run_dir: Path, method: str, reference: str) -> dict[str, dict[str, torch.Tensor]]:
    """``{user: {"in": gaps, "out": gaps}}``: ``100·(NLL_method − NLL_reference)`` per test block."""
    recipe, jobs = finished_jobs(run_dir)
    if not recipe.is_language_modelling:
        raise UserError(f"{run_dir} is a classification run", "block pairs compare language models")
    if recipe.data.clients is not None:  # the union test set holds one device per domain, not every device's
        raise UserError(f"{run_dir} deals data.clients={recipe.data.clients} devices over "
                        f"{len(recipe.data.users)} domains", "block pairs compare runs with one device per user")
    by_name = {job.method.name: job for job in jobs}
    for name in (method, reference):
        if name not in by_name:
            raise UserError(f"method '{name}' has not finished in {run_dir}", f"use one of {', '.join(by_name)}")
    gaps: dict[str, dict[str, torch.Tensor]] = {}
    for device in range(len(recipe.user_names)):
        ours, offsets = per_token_nll(by_name[method], device)
        theirs, _ = per_token_nll(by_name[reference], device)
        difference = 100.0 * (ours - theirs)
        for user in dev.users_of_device(by_name[method], device):
            name = recipe.user_names[user]
            gaps[name] = {"in": difference[offsets[user] : offsets[user + 1]], "out": difference}
    return gaps


def describe(gaps: torch.Tensor) -> tuple[float, float]:
    """Mean gap and its standard error over the blocks."""
    values = gaps.tolist()
    error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return statistics.fmean(values), error


def gap_table(runs: list[Path], method: str, reference: str) -> str:
    header = ["run", "user", f"in: Δ% vs {reference} (s.e.)", f"out: Δ% vs {reference} (s.e.)", "blocks (in/out)"]
    lines = [f"{method} against {reference}, paired per test block:", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    resolved = {"in": [], "out": []}
    for run in runs:
        for user, pair in block_gaps(run, method, reference).items():
            cells = []
            for key in ("in", "out"):
                mean, error = describe(pair[key])
                cells.append(f"{mean:+.2f} ({error:.2f})")
                resolved[key].append(abs(mean) > 2 * error)
            lines.append(f"| {run.name} | {user} | {' | '.join(cells)} | {len(pair['in'])}/{len(pair['out'])} |")
    lines.append("")
    for key, flags in resolved.items():
        lines.append(f"{key}: {sum(flags)} of {len(flags)} (run, user) gaps exceed twice their standard error")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("runs", nargs="+", type=Path, help="finished run folders holding both methods' checkpoints")
    options.add_argument("--method", required=True)
    options.add_argument("--against", required=True, metavar="METHOD")
    args = options.parse_args(argv)
    try:
        print(gap_table(args.runs, args.method, args.against))
    except UserError as error:
        raise SystemExit(f"error: {error.problem}; fix: {error.fix}") from None


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
