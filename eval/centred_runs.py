"""The cluster centres of finished runs, for the scripts here that study them (``new_users.py``,
``centre_fit.py``): which methods of a run have centres, each centre as the devices saw it at the
end, and the command line the scripts share. Imported from this folder (the scripts run as files)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.methods.fedsoft.procedure import initial_centre
from ondevice_moe.runner import finished_jobs

Result = TypeVar("Result")


def centred_jobs(run: Path, methods: list[str] | None) -> list[Job]:
    """The finished FedSoft, IFCA and FedEM methods of a language-modelling ``run`` (only ``methods``
    when given); a run of another kind of recipe is a :class:`UserError`."""
    _, jobs = finished_jobs(run)
    chosen = [job for job in jobs if job.method.procedure.server_keeps_models
              and (not methods or job.method.name in methods)]
    if chosen and not chosen[0].recipe.is_language_modelling:
        raise UserError(f"{run} is not a language-modelling run", "pass runs of a recipe with a data: section")
    return chosen


def final_centres(job: Job) -> list[dict[str, torch.Tensor]]:
    """Every centre of ``job`` as the server holds it after the last round; a centre no client ever
    contributed to (IFCA: nobody chose it) at its starting value, as the clients see it."""
    formed = dev.server_models_of(job)
    return [formed.get(centre) or initial_centre(dev.JobDevice(job, 0), centre)
            for centre in range(job.server_rule.clusters)]


def over_runs(argv: list[str] | None, description: str,
              study: Callable[[Path, list[str] | None], dict[str, Result]]) -> list[tuple[Path, dict[str, Result]]]:
    """``RUN [RUN ...] [--method METHOD ...]``: ``study`` of each run, per centred method; a bad run
    folder or no centred method at all ends the script with one message naming the fix."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("runs", nargs="+", type=Path, help="finished run folders")
    parser.add_argument("--method", action="append", help="only these methods (default: every centred method)")
    args = parser.parse_args(argv)
    try:
        studied = [(run, study(run, args.method)) for run in args.runs]
    except UserError as error:
        sys.exit(f"error: {error.problem}; fix: {error.fix}")
    if not any(results for _, results in studied):
        sys.exit("error: no finished FedSoft, IFCA or FedEM method in these runs; fix: pass their run folders")
    return studied
