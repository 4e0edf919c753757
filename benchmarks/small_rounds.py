"""Small-model rounds: the toolkit's simulation against a plain PyTorch FedAvg loop doing the same work.

Runs, side by side from this one process (each run a fresh child process, the two sides
alternating), at two round counts ``R1 < R2``:

* **plain**: ``benchmarks/plain_fedavg.py`` — the recipe's task, clients, MLP, batch size,
  learning rate, local epochs and evaluation schedule, as one plain loop;
* **flower**: ``benchmarks/flower_floor.py`` — Flower's simulation engine alone: every round, one
  message to each client carrying the model's weights and an immediate reply, no training (what
  any app on that engine pays per round on this machine);
* **toolkit**: ``ondevice-moe finetune RECIPE`` with only the FedAvg method (``fed-ft``: the whole
  model trained and averaged), a real Flower simulation into a fresh run folder; then the same
  command again on the finished folder (**rerun**: it only rewrites the report);
* **recipe** (``--whole-recipe``): every method of the recipe, in the one simulation the toolkit
  starts per recipe.

Each side's wall time ``T(R)`` gives its **per-round slope** ``(T(R2) − T(R1)) / (R2 − R1)`` and its
**fixed start-up** ``T(R1) − R1 · slope`` (process start, imports, data, Ray and Flower, report).
The figures: the toolkit's slope ÷ the plain loop's (goal ≤ 1.5) and ÷ Flower's floor, the toolkit's start-up per
method (goal ≤ 5 s) and per recipe (≤ 10 s; ``--whole-recipe``: the recipe's intercept, and
(its intercept − one method's) ÷ (methods − 1) per further method), the rerun (≤ 3 s), and both
sides' mean client accuracy after ``R2`` rounds (the same work gives about the same accuracy).

Usage:
    python benchmarks/small_rounds.py [--recipe recipes/flow-digits.yaml] [--rounds 15 115]
        [--repeats 1] [--whole-recipe] [--set key=value ...] [--output runs/small-rounds-benchmark]

Timings are only honest with nothing else running on the machine. Writes ``small_rounds.json`` and
``.md`` under ``--output``; prints the table, then (last line) the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import simulations

from ondevice_moe.errors import UserError
from ondevice_moe.federation.ray_cluster import own_instance_environment
from ondevice_moe.recipe import Recipe, load_recipe

ROOT = Path(__file__).resolve().parents[1]
FEDAVG = "methods=[{name: fed-ft, label: fedavg}]"
GOALS = {"slope_ratio": 1.5, "start_up_per_method_s": 5.0, "start_up_per_recipe_s": 10.0, "rerun_s": 3.0}


def options(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "flow-digits.yaml")
    parser.add_argument("--rounds", type=int, nargs=2, default=[15, 115], metavar=("R1", "R2"))
    parser.add_argument("--repeats", type=int, default=1, help="timings per side and round count (medians)")
    parser.add_argument("--whole-recipe", action="store_true", help="also time every method of the recipe")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe overrides for both sides, as `ondevice-moe finetune --set`")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "small-rounds-benchmark")
    args = parser.parse_args(argv)
    if not 0 < args.rounds[0] < args.rounds[1]:
        parser.error("--rounds needs R1 < R2, both positive")
    return args


def plain_arguments(recipe: Recipe) -> list[str]:
    """``plain_fedavg.py``'s options for the recipe's FedAvg; a recipe it cannot mirror is a :class:`UserError`."""
    task, training, federation = recipe.task, recipe.training, recipe.federation
    mirrored = (task is not None and task.name.startswith("digits") and recipe.model.name == "mlp"
                and training.optimizer == "sgd" and training.lr_schedule == "constant" and training.grad_clip is None
                and federation.clients_per_round in (None, task.clients) and federation.weighting == "num_examples")
    if not mirrored:
        raise UserError(f"the plain loop cannot mirror recipe '{recipe.name}'",
                        "use a digits task with model mlp, SGD at a constant rate, no clipping, every client "
                        "every round and weighting num_examples (recipes/flow-digits.yaml)")
    return ["--task", task.name, "--clients", str(task.clients), "--alpha", str(task.dirichlet_alpha),
            "--batch", str(task.batch_size), "--lr", str(training.lr), "--local-epochs", str(federation.local_epochs),
            "--eval-every", str(federation.eval_every), "--seed", str(recipe.seed), "--data-seed",
            str(recipe.split_seed)]


def timed(command: list[str]) -> tuple[float, str]:
    """Seconds ``command`` took, as a fresh process, and its output; a failure stops the benchmark."""
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                          env={**own_instance_environment(), "COLUMNS": "200"})
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return seconds, done.stdout


def toolkit(args: argparse.Namespace, rounds: int, folder: Path, methods: list[str]) -> tuple[float, float, float]:
    """Wall seconds of a fresh run, of its rerun, and the mean score of its first method."""
    shutil.rmtree(folder, ignore_errors=True)
    overrides = [part for override in args.overrides for part in ("--set", override)]
    command = [sys.executable, "-m", "ondevice_moe", "finetune", str(args.recipe), *overrides, *methods,
               "--set", f"federation.rounds={rounds}", "--output", str(folder)]
    fresh, _ = timed(command)
    rerun, _ = timed(command)
    summary = json.loads((folder / "summary.json").read_text())
    return fresh, rerun, next(iter(summary["methods"].values()))["mean_score"]


def flower(rounds: int, recipe: Recipe) -> float:
    """Wall seconds of Flower's floor: the recipe's clients, each message carrying the model's weights."""
    from ondevice_moe.federation.device import job_base_model
    from ondevice_moe.federation.job import Job

    weights = sum(p.numel() * p.element_size() for p in job_base_model(Job(recipe, 0, Path())).model.parameters())
    seconds, _ = timed([sys.executable, str(ROOT / "benchmarks" / "flower_floor.py"), "--rounds", str(rounds),
                        "--nodes", str(recipe.task.clients), "--payload-kib", str(max(1, round(weights / 1024)))])
    return seconds


def plain(rounds: int, arguments: list[str]) -> tuple[float, float]:
    seconds, output = timed([sys.executable, str(ROOT / "benchmarks" / "plain_fedavg.py"), "--rounds", str(rounds),
                             *arguments])
    return seconds, json.loads(output.strip().splitlines()[-1])["mean_accuracy"]


def line(times: dict[int, float]) -> dict[str, float]:
    """The slope and intercept of wall time over rounds through the two round counts."""
    (r1, t1), (r2, t2) = sorted(times.items())
    slope = (t2 - t1) / (r2 - r1)
    return {"per_round_s": slope, "start_up_s": t1 - r1 * slope}


def measure(args: argparse.Namespace) -> dict[str, object]:
    recipe = load_recipe(args.recipe, args.overrides)
    arguments = plain_arguments(recipe)
    sides = ["plain", "flower", "toolkit", *(["recipe"] if args.whole_recipe else [])]
    walls: dict[str, dict[int, list[float]]] = {side: {r: [] for r in args.rounds} for side in sides}
    reruns: list[float] = []
    scores: dict[str, float] = {}
    for repeat in range(args.repeats):
        order = sides if repeat % 2 == 0 else sides[::-1]  # alternate, so drift in the machine hits both
        for rounds in args.rounds:
            for side in order:
                folder = args.output / f"{side}-{rounds}-{repeat}"
                if side == "plain":
                    seconds, scores["plain"] = plain(rounds, arguments)
                elif side == "flower":
                    seconds = flower(rounds, recipe)
                else:
                    methods = ["--set", FEDAVG] if side == "toolkit" else []
                    seconds, rerun, scores[side] = toolkit(args, rounds, folder, methods)
                    if side == "toolkit":
                        reruns.append(rerun)
                walls[side][rounds].append(seconds)
    medians = {side: {r: statistics.median(times) for r, times in by_rounds.items()}
               for side, by_rounds in walls.items()}
    lines = {side: line(times) for side, times in medians.items()}
    figures: dict[str, object] = {
        "recipe": recipe.name, "rounds": args.rounds, "repeats": args.repeats, "wall_s": medians, "lines": lines,
        "slope_ratio": lines["toolkit"]["per_round_s"] / lines["plain"]["per_round_s"],
        "slope_ratio_to_flower": lines["toolkit"]["per_round_s"] / lines["flower"]["per_round_s"],
        "start_up_per_method_s": lines["toolkit"]["start_up_s"], "rerun_s": statistics.median(reruns),
        "mean_accuracy_after_r2": scores, "goals": GOALS,
    }
    if args.whole_recipe:
        methods = len(recipe.methods)
        figures["start_up_per_recipe_s"] = lines["recipe"]["start_up_s"]
        figures["start_up_per_further_method_s"] = (lines["recipe"]["start_up_s"] - lines["toolkit"]["start_up_s"]) \
            / max(methods - 1, 1)
    return figures


def markdown(figures: dict[str, object]) -> str:
    lines, walls = figures["lines"], figures["wall_s"]
    r1, r2 = figures["rounds"]
    rows = [f"Recipe `{figures['recipe']}`, {figures['repeats']} repeat(s), medians.", "",
            f"| side | wall at {r1} rounds | wall at {r2} rounds | per round | fixed start-up |",
            "|---|---|---|---|---|"]
    for side, fit in lines.items():
        rows.append(f"| {side} | {walls[side][r1]:.2f} s | {walls[side][r2]:.2f} s | "
                    f"{1000 * fit['per_round_s']:.1f} ms | {fit['start_up_s']:.2f} s |")
    goals = figures["goals"]
    rows += ["", f"- per-round slope, toolkit ÷ plain: **{figures['slope_ratio']:.2f}×** "
             f"(goal ≤ {goals['slope_ratio']}); toolkit ÷ Flower's floor: "
             f"**{figures['slope_ratio_to_flower']:.2f}×**",
             f"- start-up of a one-method recipe: **{figures['start_up_per_method_s']:.2f} s** "
             f"(goal ≤ {goals['start_up_per_method_s']:g} s per method)",
             f"- rerun of a finished run: **{figures['rerun_s']:.2f} s** (goal ≤ {goals['rerun_s']:g} s)"]
    if "start_up_per_recipe_s" in figures:
        rows.append(f"- start-up of the whole recipe: **{figures['start_up_per_recipe_s']:.2f} s** (goal ≤ "
                    f"{goals['start_up_per_recipe_s']:g} s), {figures['start_up_per_further_method_s']:.2f} s per "
                    "further method")
    accuracy = ", ".join(f"{side} {score:.2f}" for side, score in figures["mean_accuracy_after_r2"].items())
    rows.append(f"- mean client accuracy ×100 after the last run: {accuracy}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    args = options(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    try:
        figures = measure(args)
    except UserError as error:
        raise SystemExit(f"error: {error}") from None
    return simulations.publish(args.output, "small_rounds", figures, markdown(figures))


if __name__ == "__main__":
    main()
