"""The Flower ServerApp: a recipe's methods, each run by :class:`SlotStrategy`.

Under ``ondevice-moe finetune`` one simulation runs the recipe's unfinished methods one after
another on the same simulated devices (Ray, its workers and what they loaded start once per
recipe); a method that fails is logged and the next one goes on. Under ``flwr run`` (real
devices, :func:`run_submitted`) a Flower run does the same for the run config's methods, in the
run's folder on the server's own disk (:mod:`ondevice_moe.federation.server_runs`), which one
ServerApp at a time may drive; a method cut short by a crash or a stop continues from its last
completed round (:mod:`ondevice_moe.federation.round_state`), and the run's progress and files
reach the submitting machine through Flower's log stream (:mod:`ondevice_moe.federation.log_channel`).

Messages carry shared tensors only (CoMiGS Alg. 1 lines 498 and 515). Every
round the server logs per-device training metrics, the bytes it sent and
received, dropped devices, per-user test figures and the round's wall time and
overhead to ``metrics.jsonl`` in the run folder; a ``done`` record follows once the final evaluation has
written every device's checkpoint.

Under ``ondevice-moe finetune`` the runner prepares the run folder and writes
the report. Under ``flwr run`` the ServerApp does both itself, so the folder is the same either way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.exit import add_exit_handler

from ondevice_moe.errors import UserError, failure_line
from ondevice_moe.federation.device_paths import refuse_device_paths
from ondevice_moe.federation.device_state import clear_state_folder
from ondevice_moe.federation.handshake import connect
from ondevice_moe.federation.job import Job, jobs_from_context
from ondevice_moe.federation.log_channel import Channel
from ondevice_moe.federation.prompt_pulls import prompt_server
from ondevice_moe.federation.round_state import forget_rounds, load_round, save_round
from ondevice_moe.federation.server_runs import RunBusy, RunIdentity, server_lock
from ondevice_moe.federation.slots import SlotKeeper
from ondevice_moe.federation.strategy import SlotStrategy
from ondevice_moe.federation.window import IN_FLIGHT_BYTES, WindowedGrid, simulation_window
from ondevice_moe.report import MetricsLog
from ondevice_moe.run_folder import RunFolder
from ondevice_moe.stop_request import Stopped
from ondevice_moe.tracking import tracked_log

app = ServerApp()

# Set by the runner in the simulation's driver process: called after each round
# with (round, total_rounds, summary line), and as each method starts with that method's job.
progress_hook: Callable[[int, int, str], None] | None = None
method_hook: Callable[[Job], None] | None = None


@app.main()
def main(grid: Grid, context: Context) -> None:
    jobs = jobs_from_context(context)
    if jobs[0].submitted:  # `flwr run`, not the runner
        prompt_server()
        run_submitted(grid, context, jobs)
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
        except Stopped:
            break  # the runner says where it stopped
        except Exception:  # logged; the runner reports it once the other methods have run
            continue
        finally:
            clear_state_folder(job)


def run_submitted(grid: Grid, context: Context, jobs: list[Job]) -> None:
    """A ``flwr run``: the run config's methods that have not finished, in the run's folder on this
    machine, which this ServerApp holds while it lives; the outcome, the progress and the folder's
    files go to the submitter through the log (:class:`~ondevice_moe.federation.log_channel.Channel`)."""
    channel = Channel()
    folder = RunFolder(jobs[0].recipe, jobs[0].run_dir)
    config = context.run_config
    try:
        refuse_device_paths(folder.recipe)
        with server_lock(folder.path, context.run_id):
            add_exit_handler(lambda: _stopped(channel, folder), run_before_force_exit=True)
            folder.prepare(overwrite=bool(config.get("overwrite", False)))
            identity = RunIdentity.open(folder.path, {int(k): str(v) for k, v in
                                                      json.loads(str(config.get("bind") or "{}")).items()})
            failures = _run_methods(grid, folder, jobs, identity, channel)
            folder.report()
            channel.files(folder.path)
            channel.outcome("failed" if failures else "finished", "; ".join(failures))
    except RunBusy as busy:
        channel.outcome("busy", str(busy), flower_run=busy.flower_run)
    except UserError as error:
        channel.outcome("failed", str(error))


def _run_methods(grid: Grid, folder: RunFolder, jobs: list[Job], identity: RunIdentity,
                 channel: Channel) -> list[str]:
    """Run the jobs' unfinished methods on the devices, connected once; returns the failures."""
    finished = folder.finished()
    pending = [job for job in jobs if job.method.name not in finished]
    keeper = SlotKeeper(identity)
    keeper.see(grid)
    nodes: dict[int, int] = {}
    failures = []
    for position, job in enumerate(pending):
        channel.send("method", {"name": job.method.name, "index": position, "count": len(pending)})

        def progress(done: int, total: int, line: str) -> None:
            channel.send("round", {"round": done, "total": total, "line": line})

        try:
            with failure_logged(job), tracked_run_log(job) as log:
                nodes = run_federation(windowed(grid, job, True), job, log, nodes or None, keeper, identity.key,
                                       progress)
        except Exception as error:  # logged as the method's error record; the next method goes on
            failures.append(f"method '{job.method.name}' did not finish: {failure_line(error)}")
    return failures


def _stopped(channel: Channel, folder: RunFolder) -> None:
    """On a stop (``flwr stop``, or ``finetune --federation NAME --stop``), before Flower closes the log:
    the report of what finished, the folder's files and a ``stopped`` outcome (nothing, after the
    run's own outcome)."""
    if channel.closed:
        return
    try:
        folder.report()
    finally:
        channel.files(folder.path)
        channel.outcome("stopped", "the run was stopped; run the same command again to continue it from its last "
                                   "completed round")


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
    except Stopped:
        raise  # not a failure: the user asked for it
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


def run_federation(grid: Grid, job: Job, log: MetricsLog, connected: dict[int, int] | None = None,
                   keeper: SlotKeeper | None = None, run_key: str | None = None,
                   progress: Callable[[int, int, str], None] | None = None) -> dict[int, int]:
    """Train (or only evaluate) one method, then write its ``done`` record; returns the devices' nodes
    (device → node) as they stood at the end, for the next method. ``connected``: device → node of the
    devices connected already (default: connect them now: all of them, or on real devices at least
    ``federation.min_clients`` once ``federation.join_wait_s`` has passed). On real devices (a submitted
    job) ``keeper`` holds the run's slots to their keys, ``run_key`` names the run to the devices, and a
    method cut short continues from its last completed round."""
    federation = job.recipe.federation
    refused: list[tuple[int, str]] = []
    devices = len(job.method.layouts)
    if connected is None:
        nodes = connect(grid, devices, federation.reply_timeout_s, lambda node, why: refused.append((node, why)),
                        keeper.problem if keeper is not None else None,
                        enough=federation.min_clients if job.submitted else None, settle_s=federation.join_wait_s)
    else:  # a method with fewer devices (the centralized upper bound: one) uses the first of them
        nodes = {device: node for device, node in connected.items() if device < devices}
    done, slots = load_round(job, job.server_rule.initial_slots()) if job.submitted else (0, None)
    if done:
        log.discard_after(job.method.name, done)
        log.write({"method": job.method.name, "kind": "resume", "round": done})
    evaluated = any(r["kind"] == "eval" and r.get("method") == job.method.name and r.get("round") == done
                    for r in log.read()) if done else True
    strategy = SlotStrategy(job, nodes, log, progress or progress_hook, keeper, run_key, done + 1, slots,
                            (lambda server_round, kept: save_round(job, server_round, kept)) if job.submitted else None,
                            evaluation_missing=not evaluated)
    for node, why in refused:
        strategy.roster.refuse(grid, node, why)
    if strategy.total_rounds == 0:
        strategy.evaluate_untrained(grid)
    else:
        strategy.run(grid)
    log.write({"method": job.method.name, "kind": "done", "rounds": strategy.total_rounds})
    if job.submitted:
        forget_rounds(job)  # finished: the checkpoints hold what it learned
    return dict(strategy.nodes)
