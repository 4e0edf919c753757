"""The Flower ServerApp: a recipe's methods, each run by :class:`SlotStrategy`.

Under ``ondevice-moe finetune`` one simulation runs the recipe's unfinished methods one after
another on the same simulated devices (Ray, its workers and what they loaded start once per
recipe); a method that fails is logged and the next one goes on. Under ``flwr run`` a run is
one method.

Messages carry shared tensors only (CoMiGS Alg. 1 lines 498 and 515). Every
round the server logs per-device training metrics, the bytes it sent and
received, dropped devices, per-user test figures and the round's wall time and
overhead to ``metrics.jsonl`` in the run folder; a ``done`` record follows once the final evaluation has
written every device's checkpoint.

Under ``ondevice-moe finetune`` the runner prepares the run folder and writes
the report. Under ``flwr run`` (the job comes from the run config) the
ServerApp does both itself, so the folder is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ondevice_moe.errors import failure_line
from ondevice_moe.federation.device_state import clear_state_folder
from ondevice_moe.federation.job import Job, jobs_from_context
from ondevice_moe.federation.strategy import SlotStrategy, connect, pack_slots
from ondevice_moe.federation.window import IN_FLIGHT_BYTES, WindowedGrid, simulation_window
from ondevice_moe.report import MetricsLog
from ondevice_moe.run_folder import finish_report, start_method
from ondevice_moe.tracking import tracked_log

app = ServerApp()

# Set by the runner in the simulation's driver process: called after each round
# with (round, total_rounds, summary line), and as each method starts with that method's job.
progress_hook: Callable[[int, int, str], None] | None = None
method_hook: Callable[[Job], None] | None = None


@app.main()
def main(grid: Grid, context: Context) -> None:
    jobs = jobs_from_context(context)
    if context.run_config.get("recipe"):  # `flwr run`, not the runner
        run_submitted(grid, jobs[0])
        return
    devices = max(len(job.method.layouts) for job in jobs)
    nodes: dict[int, int] = {}
    for job in jobs:
        if method_hook is not None:
            method_hook(job)
        try:
            with failure_logged(job), tracked_run_log(job) as log:
                nodes = nodes or connect(grid, devices, job.recipe.federation.reply_timeout_s)
                run_federation(windowed(grid, job, False), job, log, nodes)
        except Exception:  # logged; the runner reports it once the other methods have run
            continue
        finally:
            clear_state_folder(job)


def run_submitted(grid: Grid, job: Job) -> None:
    """The one method of a ``flwr run``: the ServerApp prepares the run folder and writes the report."""
    start_method(job.recipe, job.run_dir, job.method.name)
    try:
        with failure_logged(job), tracked_run_log(job) as log:
            run_federation(windowed(grid, job, True), job, log)
    finally:  # with what it has if the method failed
        finish_report(job.recipe, job.run_dir)


def run_log(job: Job) -> MetricsLog:
    return MetricsLog(job.run_dir / "metrics.jsonl")


def tracked_run_log(job: Job) -> AbstractContextManager[MetricsLog]:
    """The run's log for ``job``'s server, feeding the trackers of the recipe's ``logging:`` section
    (an MLflow run per method, in the recipe's experiment, with the recipe's settings; docs/tracking.md)."""
    recipe = job.recipe
    return tracked_log(run_log(job).path, recipe.logging, recipe.name, job.method.name, recipe.model_dump(mode="json"))


@contextmanager
def failure_logged(job: Job) -> Iterator[None]:
    """Write a failure of ``job`` to the run's log as an ``error`` record, which the runner (or
    ``ondevice-moe finetune --federation``) reports in one line, and raise it on."""
    try:
        yield
    except Exception as error:
        message = failure_line(error)
        run_log(job).write({"method": job.method.name, "kind": "error", "message": message})
        raise


def windowed(grid: Grid, job: Job, standalone: bool) -> WindowedGrid:
    """``grid`` sending at most the recipe's ``federation.messages_in_flight`` messages at once; by default,
    in ``ondevice-moe finetune``'s simulation, two per worker or as many as :data:`IN_FLIGHT_BYTES` of
    tensors allow, whichever is more, and every device at once under ``flwr run``.

    The grid always gets its messages through :class:`WindowedGrid`, which pushes them one list at a
    time: the deployment engine's grid reads the iterable it is given twice, so a lazily built round
    handed to it directly arrives empty (SuperLink: ``messages_list must not be empty``).
    """
    federation = job.recipe.federation
    if federation.messages_in_flight is not None:
        return WindowedGrid(grid, federation.messages_in_flight)
    if standalone:
        return WindowedGrid(grid, len(job.method.layouts))
    return WindowedGrid(grid, simulation_window(federation), budget_bytes=IN_FLIGHT_BYTES)


def run_federation(grid: Grid, job: Job, log: MetricsLog, connected: dict[int, int] | None = None) -> None:
    """Train (or only evaluate) one method, then write its ``done`` record. ``connected``: device →
    node of the devices a simulation connected for all its methods (default: connect them now)."""
    federation = job.recipe.federation
    refused: list[tuple[int, str]] = []
    devices = len(job.method.layouts)
    if connected is None:
        nodes = connect(grid, devices, federation.reply_timeout_s, lambda node, why: refused.append((node, why)))
    else:  # a method with fewer devices (the centralized upper bound: one) uses the first of them
        nodes = {device: node for device, node in connected.items() if device < devices}
    strategy = SlotStrategy(job, nodes, log, progress_hook)
    for node, why in refused:
        strategy.refuse(grid, node, why)
    if strategy.total_rounds == 0:
        strategy.evaluate_untrained(grid)
    else:
        strategy.start(grid, pack_slots(strategy.slots), num_rounds=strategy.total_rounds,
                       timeout=federation.reply_timeout_s)
    log.write({"method": job.method.name, "kind": "done", "rounds": strategy.total_rounds})
