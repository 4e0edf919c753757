"""Run a recipe: every method through Flower's simulation engine, then the report.

A run folder holds ``recipe.yaml``, ``metrics.jsonl``, ``summary.json``,
``report.md``, ``plots/`` and ``checkpoints/``. Running the same recipe into
the same folder resumes it: a method counts as finished only once its ``done``
record is logged (all rounds run and every checkpoint written); the records of
a method cut short are discarded and the method runs again from round 1.
The folder itself, its lock, and the report written from its log, are
:class:`ondevice_moe.run_folder.RunFolder`'s.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ondevice_moe import stop_request
from ondevice_moe.errors import UserError, failure_line
from ondevice_moe.federation.job import JOB_ENV, Job
from ondevice_moe.federation.node import folder_node
from ondevice_moe.federation.ray_cluster import check_cluster
from ondevice_moe.methods.registry import reporters
from ondevice_moe.plan import UserCounts, data_counts
from ondevice_moe.recipe import Recipe
from ondevice_moe.report import MetricsLog, summarize
from ondevice_moe.run_folder import RunFolder, RunResult, eval_split
from ondevice_moe.stop_request import stopping_on_signals


def check_inputs(recipe: Recipe) -> list[UserCounts]:
    """Load the model and every user's data once, so bad input fails before Flower starts and before
    the run folder is written; what each user holds (``finetune --dry-run`` prints it)."""
    from ondevice_moe.federation import device

    job = Job(recipe, 0, Path("."))
    device.job_base_model(job)
    return data_counts(job)


def run_recipe(
    recipe: Recipe,
    output: Path | None = None,
    on_method: Callable[[str, int, int], None] | None = None,
    on_round: Callable[[int, int, str], None] | None = None,
    federation: str | None = None,
    overwrite: bool = False,
    bound: dict[int, str] | None = None,
) -> RunResult:
    """Run every method of ``recipe`` into the run folder (``output``, default ``runs/<name>``) and
    write the report: in Flower's simulation on this machine, or, with ``federation`` (a SuperLink
    named in Flower's connection config), on real devices (:mod:`ondevice_moe.federation.submit`),
    where the data lives on the devices and is not checked here, the run folder lives on the server,
    and ``output`` receives its report and records; ``bound``: user slots bound to SuperNode keys.

    The folder is written only once the inputs check out: input that fails its checks leaves no
    folder behind. ``overwrite`` replaces the run already in the folder (another recipe's, or this
    one's to start over); without it a run of this recipe resumes and one of another is refused."""
    if federation is not None:
        from ondevice_moe.federation.job import with_deployment_defaults

        recipe = with_deployment_defaults(recipe)
        return _run_on_devices(RunFolder(recipe, output), on_method, on_round, federation, overwrite, bound)
    folder = RunFolder(recipe, output)
    kept = folder.kept(overwrite)
    if any(name not in kept for name in folder.method_names()):
        check_inputs(recipe)  # a finished run's rerun writes its report without loading anything
        check_cluster()
    with folder.held():
        folder.prepare(overwrite)
        return _run_methods(folder, on_method, on_round)


def _run_on_devices(folder: RunFolder, on_method: Callable[[str, int, int], None] | None,
                    on_round: Callable[[int, int, str], None] | None, federation: str, overwrite: bool,
                    bound: dict[int, str] | None) -> RunResult:
    """The recipe as one Flower run on the SuperLink ``federation``; the folder receives the server's
    report and records. A failed or stopped run is a :class:`UserError` after its files arrived."""
    from ondevice_moe.federation.device_paths import refuse_device_paths
    from ondevice_moe.federation.submit import submit_run

    refuse_device_paths(folder.recipe)  # before anything is sent
    folder.kept(overwrite)  # a folder of another run is refused here already
    with folder.held():
        outcome = submit_run(folder.recipe, folder.path, federation, on_method, on_round, overwrite, bound)
    report = folder.path / "report.md"
    if outcome["status"] == "stopped":
        raise UserError(f"the run was stopped on the SuperLink '{federation}'", "run the same command again to "
                        "continue it from its last completed round")
    if outcome["status"] != "finished":
        raise UserError(outcome.get("message") or "the run failed on the server", "fix the cause and run the same "
                        f"command again: finished methods and completed rounds are kept (report: {report})")
    try:
        summary = json.loads((folder.path / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(f"the run finished, but its summary did not arrive whole ({error})",
                        "run the same command again to fetch the run's files") from None
    return RunResult(folder.path, summary, report)


def _run_methods(folder: RunFolder, on_method: Callable[[str, int, int], None] | None,
                 on_round: Callable[[int, int, str], None] | None) -> RunResult:
    recipe = folder.recipe
    pending = [Job(recipe, index, folder.path) for index in folder.restart_unfinished()]
    names = [job.method.name for job in pending]

    def announce(job: Job) -> None:
        if on_method is not None:
            on_method(job.method.name, job.method_index, len(recipe.methods))

    with stopping_on_signals(_say):
        _simulate_all(pending, announce, on_round)
        if stop_request.requested():
            result = folder.report()
            raise stop_request.Interrupted(
                f"stopped on request {folder.where_stopped(names)}", "run the same command again to resume: "
                "finished methods are kept, an unfinished one starts again from round 1 "
                f"(results so far: {result.report})")
    failures = folder.failures(names)  # the other methods went on
    result = folder.report()
    if failures:
        raise UserError("; ".join(failures), "fix the cause and run the same command again: finished methods are "
                        f"kept (their results are in {result.report})")
    return result


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


SUITES = {"lm": True, "glue": False}  # suite → is it for language-modelling runs

# What the training sent, dropped and spent on privacy: a re-scoring keeps the run's own figures.
TRAINING_FIGURES = ("comm", "drop", "privacy")


def evaluate_run(run_dir: Path, suite: str | None = None, device: str | None = None, split: str | None = None,
                 methods: list[str] | None = None) -> dict[str, Any]:
    """Re-evaluate every device of a run's finished methods from their checkpoints.

    ``lm``: per-user test perplexity in and out of distribution; ``glue``: the task metric per
    client; ``None``: the suite of the run's own task. ``device`` (``auto`` | ``cpu`` | ``cuda``)
    overrides the run's ``model.device``; ``split`` (``test`` | ``valid``) the split the users are
    scored on (``data.eval_split`` or ``task.eval_split``: a run that chose its learning rate on
    ``valid`` scored on ``test``, the same trained models); ``methods``: only these of the run's
    finished methods.
    Returns a summary shaped like ``summary.json``.
    """
    from ondevice_moe.federation import device as dev
    from ondevice_moe.federation.evaluation import evaluate_device, user_values

    if suite is not None and suite not in SUITES:
        raise UserError(f"unknown suite '{suite}'", f"use one of {list(SUITES)}")
    recipe, jobs = finished_jobs(run_dir, device, split)
    if methods is not None:
        jobs = [job for job in jobs if job.method.name in methods]
    suite = suite or ("lm" if recipe.is_language_modelling else "glue")  # the run knows its task
    if SUITES[suite] != recipe.is_language_modelling:
        kind = "language-modelling" if recipe.is_language_modelling else "classification"
        right = "lm" if recipe.is_language_modelling else "glue"
        raise UserError(f"suite '{suite}' does not fit this {kind} run", f"use --suite {right}")
    folder = RunFolder(recipe, run_dir)
    logged = folder.log.read()
    records = []
    for job in jobs:
        trained_to = last_round(logged, job.method.name)
        for device_index in [job.node.partition_id] if job.on_device else range(len(job.method.layouts)):
            model = dev.build_model(job, device_index)
            if job.method.trains:
                dev.load_checkpoint(job, device_index, model)
            metrics = evaluate_device(job, device_index, model)
            for user_index, user in enumerate(recipe.user_names):
                values = user_values(metrics, user_index)
                if values:
                    records.append({"method": job.method.name, "round": trained_to, "kind": "eval", "user": user,
                                    **values})
    names = [job.method.name for job in jobs]
    trained = [record for record in logged if record.get("method") in names and record["kind"] in TRAINING_FIGURES]
    summary = summarize(trained + records, names, recipe.user_names, recipe.metric, eval_split(recipe), reporters())
    unfinished = folder.still_training()
    return {**summary, "still_training": unfinished} if unfinished else summary


def last_round(records: list[dict[str, Any]], method: str) -> int:
    """The last round ``method`` logged: the round its checkpoints hold (0 for a method that does not train)."""
    return max((r["round"] for r in records if r.get("method") == method and isinstance(r.get("round"), int)),
               default=0)


def finished_jobs(run_dir: Path, device: str | None = None, split: str | None = None) -> tuple[Recipe, list[Job]]:
    """A run folder's recipe and the jobs of its finished methods (``device`` overrides
    ``model.device``, ``split`` ``data.eval_split`` or ``task.eval_split``); a folder that is not a
    run, or has nothing finished, is a :class:`UserError`."""
    folder = RunFolder.read(Path(run_dir), device, split)
    finished = folder.finished()
    node = folder_node(folder.path)  # a real device's own folder: its model, its data only
    jobs = [job for job in (Job(folder.recipe, index, folder.path, node) for index in range(len(folder.recipe.methods)))
            if job.method.name in finished]  # a `flwr run` folder may hold one method of the recipe
    if not jobs:
        raise UserError(f"no method of the run in {run_dir} has finished", "finish it first: run the same "
                        "`ondevice-moe finetune` command again to resume")
    return folder.recipe, jobs


def gpus_per_client(job: Job) -> float:
    """The recipe's ``federation.gpus_per_client``; on CUDA without it, the devices share one GPU."""
    from ondevice_moe.models.devices import resolve_device

    federation = job.recipe.federation
    if federation.gpus_per_client > 0 or resolve_device(job.recipe.model.device).type != "cuda":
        return federation.gpus_per_client
    return 1.0 / len(job.method.layouts)


def _simulate_all(jobs: list[Job], announce: Callable[[Job], None],
                  on_round: Callable[[int, int, str], None] | None) -> None:
    """Run ``jobs`` in Flower's simulation, one after another in one simulation (Ray, its workers and
    what they load start once). Should the simulation itself end early, the method it was running
    gets an ``error`` record and the methods it never started run in a new one."""
    if not jobs:
        return
    log = MetricsLog(jobs[0].run_dir / "metrics.jsonl")
    while jobs:
        problem = "the simulation ended before this method did"
        try:
            _simulate(jobs, announce, on_round)
        except Exception as error:
            problem = failure_line(error)
        if stop_request.requested():
            return  # the method cut short is discarded on the rerun
        records = log.read()
        started = {record["method"] for record in records}
        ended = {record["method"] for record in records if record["kind"] in ("done", "error")}
        unstarted = [job for job in jobs if job.method.name not in started]
        stalled = unstarted[:1] == jobs[:1]  # not even the first method started: another try would fare no better
        for job in jobs:
            if (job.method.name in started and job.method.name not in ended) or (stalled and job in unstarted):
                log.write({"method": job.method.name, "kind": "error", "message": problem})
        jobs = [] if stalled else unstarted


def _simulate(jobs: list[Job], announce: Callable[[Job], None],
              on_round: Callable[[int, int, str], None] | None) -> None:
    from flwr.simulation import run_simulation

    from ondevice_moe.federation import client_app, server_app
    from ondevice_moe.federation.ray_cluster import simulation_ray
    from ondevice_moe.federation.window import simulation_cpus

    first = jobs[0]
    job_file = first.to_file(first.run_dir / ".jobs.json", [job.method_index for job in jobs])
    os.environ[JOB_ENV] = str(job_file.resolve())
    federation = first.recipe.federation
    backend = {
        "init_args": {"num_cpus": simulation_cpus(federation), "logging_level": "ERROR",
                      "log_to_driver": False, "include_dashboard": False},
        "client_resources": {"num_cpus": federation.cpus_per_client,
                             "num_gpus": max(gpus_per_client(job) for job in jobs)},
    }
    server_app.progress_hook, server_app.method_hook = on_round, announce
    try:
        with warnings.catch_warnings(), simulation_ray():
            warnings.simplefilter("ignore")
            # A device that raises shows up once, as a dropped device with its reason (progress line,
            # report, metrics.jsonl); Flower's own log of the actor's traceback would repeat it.
            logging.getLogger("flwr").setLevel(logging.CRITICAL)
            run_simulation(server_app=server_app.app, client_app=client_app.app,
                           num_supernodes=max(len(job.method.layouts) for job in jobs), backend_config=backend)
    finally:
        server_app.progress_hook = server_app.method_hook = None
