"""The Flower ServerApp: one method of a recipe, run by :class:`SlotStrategy`.

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

from collections.abc import Callable

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ondevice_moe.errors import UserError
from ondevice_moe.federation.job import Job, job_from_context
from ondevice_moe.federation.strategy import SlotStrategy, connect, pack_slots
from ondevice_moe.federation.window import WindowedGrid, simulation_window
from ondevice_moe.report import MetricsLog

app = ServerApp()

# Set by the CLI in the simulation's driver process: called after each round
# with (round, total_rounds, summary line).
progress_hook: Callable[[int, int, str], None] | None = None


@app.main()
def main(grid: Grid, context: Context) -> None:
    job = job_from_context(context)
    standalone = bool(context.run_config.get("recipe"))  # `flwr run`, not the runner
    if standalone:
        from ondevice_moe import runner

        runner.start_method(job)
    log = MetricsLog(job.run_dir / "metrics.jsonl")
    try:
        run_federation(WindowedGrid(grid, message_window(job, standalone)), job, log)
    except Exception as error:
        # The driver (or `ondevice-moe finetune --federation`) reads this record to report the failure in one line.
        message = error.problem if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
        log.write({"method": job.method.name, "kind": "error", "message": message})
        raise
    finally:
        if standalone:  # under `flwr run` the ServerApp writes the report, with what it has if the method failed
            runner.finish_report(job.recipe, job.run_dir)


def message_window(job: Job, standalone: bool) -> int:
    """How many messages may be out at once: the recipe's ``federation.messages_in_flight``; by default
    two per simulation worker under ``ondevice-moe finetune``, and every device at once under ``flwr run``.

    The grid always gets its messages through :class:`WindowedGrid`, which pushes them one list at a
    time: the deployment engine's grid reads the iterable it is given twice, so a lazily built round
    handed to it directly arrives empty (SuperLink: ``messages_list must not be empty``).
    """
    federation = job.recipe.federation
    if federation.messages_in_flight is not None:
        return federation.messages_in_flight
    return len(job.method.layouts) if standalone else simulation_window(federation)


def run_federation(grid: Grid, job: Job, log: MetricsLog) -> None:
    """Train (or only evaluate) one method, then write its ``done`` record."""
    federation = job.recipe.federation
    refused: list[tuple[int, str]] = []
    nodes = connect(grid, len(job.method.layouts), federation.reply_timeout_s,
                    lambda node, why: refused.append((node, why)))
    strategy = SlotStrategy(job, nodes, log, progress_hook)
    for node, why in refused:
        strategy.refuse(grid, node, why)
    if strategy.total_rounds == 0:
        strategy.evaluate_untrained(grid)
    else:
        strategy.start(grid, pack_slots(strategy.slots), num_rounds=strategy.total_rounds,
                       timeout=federation.reply_timeout_s)
    log.write({"method": job.method.name, "kind": "done", "rounds": strategy.total_rounds})
