"""The Flower ServerApp: rounds of train → aggregate → evaluate, one method at a time.

Messages carry shared tensors only (CoMiGS Alg. 1 lines 498 and 515). Every
round the server logs per-device training metrics, the bytes it sent and
received, and per-user test perplexities to ``metrics.jsonl`` in the run folder.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from ondevice_moe.federation.aggregation import (
    Update,
    Weighting,
    average,
    check_update,
    example_weighting,
    inverse_frequency_weighting,
)
from ondevice_moe.federation.evaluation import user_values
from ondevice_moe.federation.job import Job, job_from_context
from ondevice_moe.report import MetricsLog

app = ServerApp()

# Set by the CLI in the simulation's driver process: called after each round
# with (round, total_rounds, summary line).
progress_hook: Callable[[int, int, str], None] | None = None

NODE_WAIT_SECONDS = 300.0


@app.main()
def main(grid: Grid, context: Context) -> None:
    job = job_from_context(context)
    try:
        run_federation(grid, job)
    except Exception as error:
        # The driver reads this record to report the failure in one line.
        MetricsLog(job.run_dir / "metrics.jsonl").write(
            {"method": job.method.name, "kind": "error", "message": f"{type(error).__name__}: {error}"})
        raise


def run_federation(grid: Grid, job: Job) -> None:
    method = job.method
    log = MetricsLog(job.run_dir / "metrics.jsonl")
    nodes = _wait_for_nodes(grid, len(method.layouts))
    users = job.recipe.user_names
    weighting = _weighting(job)
    total_rounds = job.recipe.federation.rounds if method.trains else 0
    shared: dict[str, torch.Tensor] = {}
    if total_rounds == 0:
        mean_in = _evaluate(grid, nodes, shared, job, users, 0, log)
        if progress_hook is not None:
            progress_hook(0, 0, f"evaluated: mean {mean_in:.2f}")
    for server_round in range(1, total_rounds + 1):
        started = time.perf_counter()
        updates, bytes_up = _train_round(grid, nodes, shared, job, server_round, log)
        sound = []
        for update in updates:
            problem = check_update(update, shared or None, partial=method.upload_selected_only)
            if problem:
                log.write({"method": method.name, "round": server_round, "kind": "warning",
                           "message": f"update rejected: {problem}"})
            else:
                sound.append(update)
        if not sound:
            raise RuntimeError(f"round {server_round}: no device sent a usable update; see metrics.jsonl")
        if any(u.tensors for u in sound):
            # Experts nobody uploaded this round keep their last global value (Hermes broadcasts all).
            shared = {**shared, **average(sound, weighting)}
        down_bytes = _bytes(shared) * len(nodes)
        log.write({"method": method.name, "round": server_round, "kind": "comm", "bytes_up": bytes_up,
                   "bytes_down": down_bytes, "devices": len(sound)})
        mean_in = _evaluate(grid, nodes, shared, job, users, server_round, log, final=server_round == total_rounds)
        if progress_hook is not None:
            label = "mean test ppl" if job.recipe.is_language_modelling else "mean score"
            progress_hook(server_round, total_rounds,
                          f"round {server_round}: {label} {mean_in:.2f}, "
                          f"upload {bytes_up / 1024:.0f} KiB, {time.perf_counter() - started:.0f}s")


def _train_round(grid: Grid, nodes: list[int], shared: dict[str, torch.Tensor], job: Job,
                 server_round: int, log: MetricsLog) -> tuple[list[Update], int]:
    replies = _send(grid, nodes, shared, MessageType.TRAIN, server_round)
    updates, bytes_up = [], 0
    for reply in replies:
        metrics = dict(reply.content["metrics"])
        arrays = reply.content["arrays"]
        bytes_up += _record_bytes(arrays)
        if "usage" in reply.content:
            bytes_up += reply.content["usage"].count_bytes()
        device = int(metrics.pop("device"))
        usage = dict(reply.content["usage"]) if "usage" in reply.content else {}
        updates.append(Update(device, dict(arrays.to_torch_state_dict()), int(metrics["num-examples"]), usage))
        user = job.recipe.user_names[device] if not job.method.centralized else "all"
        log.write({"method": job.method.name, "round": server_round, "kind": "train", "user": user, **metrics})
    return updates, bytes_up


def _evaluate(grid: Grid, nodes: list[int], shared: dict[str, torch.Tensor], job: Job, users: list[str],
              server_round: int, log: MetricsLog, final: bool = True) -> float:
    """Ask every device for its test figures; after the last round they also save checkpoints."""
    replies = _send(grid, nodes, shared, MessageType.EVALUATE, server_round, final)
    headline = []
    for reply in replies:
        metrics = reply.content["metrics"]
        for index, name in enumerate(users):
            values = user_values(dict(metrics), index)
            if values:
                headline.append(values.get("test_ppl_in", values.get("score")))
                log.write({"method": job.method.name, "round": server_round, "kind": "eval", "user": name,
                           **values})
    return sum(headline) / max(len(headline), 1)


def _weighting(job: Job) -> Weighting:
    per_device = example_weighting(job.recipe.federation.weighting)
    if job.method.aggregation == "inverse_frequency":
        return inverse_frequency_weighting(job.method.aggregation_alpha, job.method.aggregation_epsilon, per_device)
    return per_device


def _send(grid: Grid, nodes: list[int], shared: dict[str, torch.Tensor], kind: str, server_round: int,
          final: bool = False) -> list[Message]:
    config = ConfigRecord({"server-round": server_round, "final": final})
    content = RecordDict({"arrays": ArrayRecord(shared), "config": config})
    messages = [Message(content, dst_node_id=node, message_type=kind, group_id=str(server_round)) for node in nodes]
    replies = list(grid.send_and_receive(messages))
    failures = [reply.error.reason for reply in replies if reply.has_error()]
    if failures:
        raise RuntimeError(f"{len(failures)} device(s) failed in round {server_round} ({kind}): "
                           f"{_last_line(failures[0])}")
    return replies


def _last_line(reason: str) -> str:
    lines = [line.strip() for line in reason.replace("\\n", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else reason


def _record_bytes(record: ArrayRecord) -> int:
    return int(sum(array.numpy().nbytes for array in record.values()))


def _bytes(tensors: dict[str, Any]) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors.values()))


def _wait_for_nodes(grid: Grid, count: int) -> list[int]:
    """Node ids, once ``count`` devices have connected (simulation registers them lazily)."""
    deadline = time.monotonic() + NODE_WAIT_SECONDS
    while len(nodes := sorted(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} of {count} devices connected within {NODE_WAIT_SECONDS:.0f}s")
        time.sleep(0.2)
    return nodes[:count]
