"""The run's plots: expert scores, rounds, loss curves and communication."""

from __future__ import annotations

import io
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from ondevice_moe.report.log import step_losses
from ondevice_moe.report.summary import format_bytes
from ondevice_moe.safe_files import write_bytes

SCORE_KEY = re.compile(r"layer_(\d+)/expert_(.+)_score")  # a train record's mean routing weight of an expert
PANEL_COLUMNS = 4


def plot_expert_scores(records: list[dict[str, Any]], method: str, path: Path) -> Path | None:
    """Each expert's routing score over rounds (CoMiGS Fig. 4), a panel per device: one line per
    expert, its mean over the layers, in a band from its lowest to its highest layer."""
    trains = [r for r in records if r["method"] == method and r["kind"] == "train"]
    by_user: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in trains:
        by_user[record["user"]].append(record)
    experts = sorted({m[2] for r in trains for key in r if (m := SCORE_KEY.fullmatch(key))},
                     key=lambda name: (not name.startswith("shared"), name))  # generalists first
    if not experts:
        return None
    plt = pyplot()
    columns = min(len(by_user), PANEL_COLUMNS)
    rows = -(-len(by_user) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3.2 * rows), squeeze=False, sharey=True)
    for axis, (user, user_records) in zip(axes.flat, sorted(by_user.items()), strict=False):
        user_records.sort(key=lambda r: r["round"])
        for expert in experts:
            rounds, layers = _scores_by_round(user_records, expert)
            if rounds:
                line, = axis.plot(rounds, [statistics.fmean(s) for s in layers], marker=".", label=expert)
                axis.fill_between(rounds, [min(s) for s in layers], [max(s) for s in layers],
                                  color=line.get_color(), alpha=0.2, linewidth=0)
        axis.set_title(user)
        axis.set_xlabel("round")
        integer_ticks(axis)
    for axis in axes.flat[len(by_user):]:
        axis.set_visible(False)
    for row in axes:
        row[0].set_ylabel("score: mean over layers")
    axes[0][0].legend(title="expert", fontsize="small")
    figure.suptitle(f"{method}: expert scores (band: lowest to highest layer)")
    return save_figure(figure, path)


def _scores_by_round(records: list[dict[str, Any]], expert: str) -> tuple[list[int], list[list[float]]]:
    """The rounds of ``records`` (one device's, in order) scoring ``expert``, and its score per layer in each."""
    rounds, layers = [], []
    for record in records:
        scores = [value for key, value in record.items() if (m := SCORE_KEY.fullmatch(key)) and m[2] == expert]
        if scores:
            rounds.append(record["round"])
            layers.append(scores)
    return rounds, layers


def plot_rounds(records: list[dict[str, Any]], methods: list[str], path: Path) -> Path | None:
    """Mean headline value (in-distribution perplexity or score) over rounds, one line per method."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.6))
    if not _draw_rounds(axis, records, methods):
        plt.close(figure)
        return None
    return save_figure(figure, path)


def _draw_rounds(axis: Any, records: list[dict[str, Any]], methods: list[str]) -> bool:
    """Draw each method's mean headline value over users per round on ``axis`` (an untrained
    reference as a dashed level); whether there was anything to draw."""
    drawn = False
    for method in methods:
        by_round: dict[int, list[float]] = defaultdict(list)
        for r in records:
            if r["method"] == method and r["kind"] == "eval":
                by_round[r["round"]].append(r.get("test_ppl_in", r.get("score")))
        if list(by_round) == [0]:  # an untrained reference, e.g. the pretrained model
            axis.axhline(statistics.fmean(by_round[0]), linestyle="--", color="grey", label=method)
            drawn = True
        elif by_round:
            rounds = sorted(by_round)
            axis.plot(rounds, [statistics.fmean(by_round[k]) for k in rounds], marker="o", label=method)
            drawn = True
    if drawn:
        axis.set_xlabel("round")
        integer_ticks(axis)
        language = any("test_ppl_in" in r for r in records if r["kind"] == "eval")
        axis.set_ylabel("mean test perplexity (in-dist)" if language else "mean test score")
        axis.legend(fontsize="small")
    return drawn


# Losses of a method's phases other than its plain training steps, per round: name in the legend.
# Routers step on the router split: the validation split, or training batches in CoMiGS's -tr ablation.
PHASE_LOSSES = {"router_loss": "router steps", "train_loss_local": "local phase"}


def plot_loss_curves(records: list[dict[str, Any]], methods: list[str], path: Path) -> Path | None:
    """Training loss per step, mean over the devices (a method that logs no step losses: its round
    means, at each round's last step); each phase's mean loss per round, where methods have phases
    (routers on the router split, Flow's local phase); and the test metric per round."""
    trained = [method for method in methods if any(r["method"] == method and r["kind"] == "train" for r in records)]
    if not trained:
        return None
    phases = {(r["method"], key) for r in records if r["kind"] == "train" and r["method"] in trained
              for key in PHASE_LOSSES if key in r}
    plt = pyplot()
    figure, axes = plt.subplots(1, 3 if phases else 2, figsize=(15 if phases else 10, 3.8), squeeze=False)
    steps_axis, *phase_axes, test_axis = axes[0]
    for method in trained:
        trains = [r for r in records if r["method"] == method and r["kind"] == "train"]
        per_step = [point for r in trains for point in step_losses(r)]
        round_means = not per_step
        if round_means:  # each round's mean loss, as one step at the round's end
            per_step = [point for r in trains if "train_loss" in r
                        for point in step_losses({**r, "step_losses": [r["train_loss"]]})]
        steps, means = _means_by(per_step)
        steps_axis.plot(steps, means, marker="o" if round_means else None, label=method)
    steps_axis.set(xlabel="step (each device's own count)", ylabel="training loss, mean over devices")
    integer_ticks(steps_axis)
    steps_axis.legend(fontsize="small")
    for axis in phase_axes:
        for method, key in sorted(phases):
            rounds, means = _means_by([(r["round"], r[key]) for r in records
                                       if r["method"] == method and r["kind"] == "train" and key in r])
            axis.plot(rounds, means, marker="o", label=f"{method}: {PHASE_LOSSES[key]}")
        axis.set(xlabel="round", ylabel="phase loss, mean over devices")
        integer_ticks(axis)
        axis.legend(fontsize="small")
    _draw_rounds(test_axis, records, methods)
    return save_figure(figure, path)


def _means_by(points: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    """The mean value at each x of ``(x, value)`` points, in order of x."""
    grouped: dict[int, list[float]] = defaultdict(list)
    for x, value in points:
        grouped[x].append(value)
    xs = sorted(grouped)
    return xs, [statistics.fmean(grouped[x]) for x in xs]


def plot_communication(records: list[dict[str, Any]], methods: list[str], path: Path) -> Path | None:
    """Bytes uploaded per round by all devices, one bar per method (Hermes Fig. 3b)."""
    uploads = {}
    for method in methods:
        comm = [r["bytes_up"] for r in records if r["method"] == method and r["kind"] == "comm"]
        if comm:
            uploads[method] = statistics.fmean(comm) / 2**20
    if not uploads:
        return None
    figure, axis = pyplot().subplots(figsize=(max(4.0, 0.8 * len(uploads) + 2), 3.6))
    bars = axis.bar(list(uploads), list(uploads.values()), color="tab:blue")
    # A linear axis, so bar heights compare; full fine-tuning can dwarf the PEFT bars, so each carries its value.
    axis.bar_label(bars, labels=[format_bytes(mib * 2**20) for mib in uploads.values()], fontsize="small")
    axis.margins(y=0.15)
    axis.set_ylabel("upload per round,\nall devices (MiB)")
    axis.tick_params(axis="x", labelrotation=45)
    for label in axis.get_xticklabels():
        label.set_horizontalalignment("right")
    return save_figure(figure, path)


def pyplot() -> Any:
    """matplotlib's ``pyplot`` on the file-only Agg backend, imported where a picture is drawn: a device's
    worker process, which imports this module for its records, never draws (and starts faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot


def integer_ticks(axis: Any) -> None:
    """Round numbers on ``axis``'s x axis: whole numbers, as many as fit (1,500 rounds get a readable axis)."""
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))


def save_figure(figure: Any, path: Path) -> Path:
    plt = pyplot()
    figure.tight_layout()
    picture = io.BytesIO()
    figure.savefig(picture, dpi=110, format="png")
    plt.close(figure)
    write_bytes(path, picture.getvalue())
    return path
