"""Choose each method's learning rate on the validation split, never the test split; then test it.

Usage: python eval/lr_sweep.py RECIPE --rates R [R ...] [--seed S] [--out FOLDER] [--set KEY=VALUE ...]
                               [--select in|out] [--test-seeds S [S ...]] [--against METHOD] [--dry-run]

Sweep: for every rate R, ``ondevice-moe finetune RECIPE --seed S --set data.eval_split=valid
--set training.lr=R`` (and every ``--set``) into ``FOLDER/valid-lr<R>-s<S>``: every method of the
recipe trains at R and is scored on each user's validation split (``data.valid_tokens``). A
classification recipe is scored on its clients' validation examples instead (``task.eval_split=valid``;
the recipe, or a ``--set``, gives ``task.valid_examples``, held out of the training split). A folder
that already holds a ``summary.json`` is not run again, so an interrupted sweep goes on where it
stopped. Then, per method, the mean over users of the validation perplexity in and out of
distribution (or of the task's score) at every rate, and the best rate by ``--select`` (``in``, the
default: each user's own domain, or the task's score; ``out``: the union of the users' domains): the
lowest perplexity or error, the highest accuracy. A best rate at an edge of the grid is flagged:
widen the grid there.

Test (``--test-seeds``): for every seed, each method at its own best rate, scored on the test split:
one run per distinct best rate, holding the methods that chose it (``--set methods=[...]``), into
``FOLDER/test-lr<R>-s<SEED>``; then ``ondevice-moe compare``'s table over the seeds (a seed's folders
joined with ``+``) and, with ``--against METHOD``, the paired test against METHOD. For the sweep's
own seed the models are already trained: its validation run at the best rate is re-scored on the
test split from its checkpoints (``ondevice-moe eval RUN --split test``; the summary's
``rescored_from`` names the run), unless ``--retrain-sweep-seed``.

Every run is one process after another (one ``ondevice-moe finetune`` at a time); each one's wall
time is printed and kept in ``FOLDER/wall_times.json``. A run that fails is reported and the sweep
goes on: its unfinished methods count as failed at that rate (``failed`` in the table), and the
sweep run again resumes it. ``--dry-run`` prints the commands only.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ondevice_moe.compare import comparison
from ondevice_moe.errors import UserError
from ondevice_moe.metrics import lower_is_better
from ondevice_moe.recipe import Recipe, load_recipe

SELECT = {"in": "mean_in", "out": "mean_out"}
SPLIT_KEYS = ("data.eval_split", "task.eval_split")


def rate_name(rate: float) -> str:
    """A rate as a folder name part: ``0.002`` → ``0.002``, ``5e-4`` → ``0.0005``."""
    return f"{rate:g}"


def run_folder(out: Path, split: str, rate: float, seed: int) -> Path:
    return out / f"{split}-lr{rate_name(rate)}-s{seed}"


def finetune_command(recipe: Path, folder: Path, rate: float, seed: int, split: str, overrides: list[str],
                     methods: list[dict] | None = None, split_key: str = "data.eval_split") -> list[str]:
    """The ``ondevice-moe finetune`` command of one run (``methods``: the recipe's entries to keep;
    ``split_key``: ``data.eval_split`` for a language model, ``task.eval_split`` for a task)."""
    # This interpreter's package, so the sweep runs from a virtual environment that is not on PATH.
    command = [sys.executable, "-m", "ondevice_moe", "finetune", str(recipe), "--seed", str(seed),
               "--output", str(folder)]
    for override in [*overrides, f"{split_key}={split}", f"training.lr={rate!r}"]:
        command += ["--set", override]
    if methods is not None:
        command += ["--set", "methods=" + json.dumps(methods)]
    return command


def finished_methods(folder: Path) -> set[str]:
    """The methods a run folder's ``summary.json`` holds (none without one)."""
    path = folder / "summary.json"
    return set(json.loads(path.read_text(encoding="utf-8"))["methods"]) if path.is_file() else set()


def run(command: list[str], folder: Path, out: Path, dry_run: bool, methods: list[str]) -> None:
    """Run ``command`` unless ``folder`` holds every one of ``methods`` finished; print and keep its
    wall time. A run that fails is reported and the sweep goes on: the methods it did not finish
    count as failed at that rate, and running the sweep again resumes the run (``finetune`` keeps
    what finished)."""
    if set(methods) <= finished_methods(folder):
        print(f"kept: {folder} (finished before)", flush=True)
        return
    print("$ " + shlex.join(command), flush=True)
    if dry_run:
        return
    start = time.monotonic()
    status = subprocess.run(command, check=False).returncode
    seconds = time.monotonic() - start
    if status != 0:
        missing = sorted(set(methods) - finished_methods(folder))
        print(f"error: {folder.name} stopped (exit status {status}) before {', '.join(missing)} finished; "
              "they count as failed at this rate. fix: see the error above, then run the sweep again "
              "(finished methods are kept)", flush=True)
    times_path = out / "wall_times.json"
    times = json.loads(times_path.read_text(encoding="utf-8")) if times_path.is_file() else {}
    times[folder.name] = round(seconds, 1)
    times_path.write_text(json.dumps(times, indent=2), encoding="utf-8")
    print(f"wall time {folder.name}: {seconds / 60:.1f} min", flush=True)


def rescore_on_test(valid_folder: Path, folder: Path, methods: list[str], dry_run: bool) -> None:
    """The sweep seed's test figures: ``valid_folder``'s trained ``methods`` scored on the test split
    from their checkpoints, written as ``folder/summary.json``."""
    if (folder / "summary.json").is_file():
        print(f"kept: {folder} (finished before)", flush=True)
        return
    print(f"re-scoring {', '.join(methods)} of {valid_folder} on the test split into {folder}", flush=True)
    if dry_run:
        return
    from ondevice_moe.runner import evaluate_run

    start = time.monotonic()
    summary = evaluate_run(valid_folder, split="test", methods=methods)
    summary["rescored_from"] = str(valid_folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    print(f"wall time re-scoring {folder.name}: {(time.monotonic() - start) / 60:.1f} min", flush=True)


def read_summary(folder: Path, split: str) -> dict:
    """A run's summary, checked to be scored on ``split``; a run that wrote none holds no methods."""
    if not (folder / "summary.json").is_file():
        return {"eval_split": split, "methods": {}}
    summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    scored = summary.get("eval_split", "test")
    if scored != split:
        raise SystemExit(f"error: {folder} was scored on the {scored} split, not {split}; "
                         "fix: remove the folder and run again")
    return summary


def sweep_table(summaries: dict[float, dict], select: str) -> tuple[str, dict[str, float]]:
    """The validation table (a row per method, per rate ``in / out``, or the task's score) and each
    method's best rate: the lowest perplexity or error, the highest score."""
    rates = sorted(summaries)
    methods = list(dict.fromkeys(m for r in rates for m in summaries[r]["methods"]))
    metric = next((summary["metric"] for summary in summaries.values() if "metric" in summary), "perplexity")
    language = metric == "perplexity"
    if not language and select != "in":
        raise SystemExit(f"error: --select {select} chooses among a language model's perplexities; a task has one "
                         f"score ({metric}); fix: drop --select")
    key = SELECT[select] if language else "mean_score"
    lowest = lower_is_better(metric)
    scored = "valid ppl in / out" if language else f"valid {metric}"
    header = ["method", *(f"lr {rate_name(r)}: {scored}" for r in rates), f"best lr (valid {select})"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    best: dict[str, float] = {}
    for method in methods:
        entries = {r: summaries[r]["methods"].get(method) for r in rates}
        values = {r: e.get(key) for r, e in entries.items() if e is not None}
        finite = {r: v for r, v in values.items() if v is not None and math.isfinite(v)}
        cells = ["failed" if e is None else f"{_cell(e.get('mean_in'))} / {_cell(e.get('mean_out'))}" if language
                 else _cell(e.get(key)) for e in entries.values()]
        if finite:
            best[method] = (min if lowest else max)(finite, key=finite.get)
            edge = " (edge of the grid)" if len(rates) > 1 and best[method] in (rates[0], rates[-1]) else ""
            cells.append(rate_name(best[method]) + edge)
        else:
            cells.append("diverged or failed at every rate")
        lines.append(f"| {method} | {' | '.join(cells)} |")
    return "\n".join(lines), best


def _cell(value: float | None) -> str:
    return "diverged" if value is None or not math.isfinite(value) else f"{value:.2f}"


def entries_by_method(recipe: Recipe) -> dict[str, dict]:
    """Each method's recipe entry as written, by the method's name in the run (its label)."""
    return {recipe.method(i).name: {"name": entry.name, **entry.raw_options()}
            for i, entry in enumerate(recipe.methods)}


def main(argv: list[str]) -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("recipe", type=Path)
    options.add_argument("--rates", type=float, nargs="+", required=True, help="learning rates to sweep")
    options.add_argument("--seed", type=int, default=0, help="the sweep's seed (default 0)")
    options.add_argument("--out", type=Path, help="folder of the runs (default runs/sweep-<recipe name>)")
    options.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="a recipe override for every run (as ondevice-moe finetune --set)")
    options.add_argument("--select", choices=sorted(SELECT), default="in",
                         help="the validation value a rate is chosen by (default in: each user's own domain)")
    options.add_argument("--test-seeds", type=int, nargs="*", default=[],
                         help="then run each method at its best rate on the test split for these seeds")
    options.add_argument("--against", metavar="METHOD", help="paired test of the test runs against METHOD")
    options.add_argument("--retrain-sweep-seed", action="store_true",
                         help="train the sweep's seed again for the test figures instead of re-scoring its runs")
    options.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    args = options.parse_args(argv)
    if any(o.split("=", 1)[0] in (*SPLIT_KEYS, "training.lr") for o in args.overrides):
        raise SystemExit("error: --set data.eval_split / task.eval_split / training.lr are the sweep's own; "
                         "fix: drop them")
    recipe = load_recipe(args.recipe, args.overrides, args.seed)
    split_key = SPLIT_KEYS[0] if recipe.is_language_modelling else SPLIT_KEYS[1]
    if not recipe.is_language_modelling and recipe.task.valid_examples is None:
        raise SystemExit(f"error: {args.recipe} is a classification recipe without a validation split; fix: add "
                         "--set task.valid_examples=N (examples held out of the training split, for every run)")
    out = args.out or Path("runs") / f"sweep-{recipe.name}"
    out.mkdir(parents=True, exist_ok=True)
    rates = sorted(set(args.rates))
    entries = entries_by_method(recipe)
    for rate in rates:
        run(finetune_command(args.recipe, run_folder(out, "valid", rate, args.seed), rate, args.seed, "valid",
                             args.overrides, split_key=split_key), run_folder(out, "valid", rate, args.seed), out,
            args.dry_run, list(entries))
    if args.dry_run:
        return
    summaries = {rate: read_summary(run_folder(out, "valid", rate, args.seed), "valid") for rate in rates}
    table, best = sweep_table(summaries, args.select)
    scored = "perplexity" if recipe.is_language_modelling else recipe.metric
    print(f"\nValidation {scored} ({split_key}: valid), seed {args.seed}, mean over users; "
          f"best rate by valid {args.select}:\n")
    print(table)
    print("\nbest rate per method on valid: " + ", ".join(f"{m} {rate_name(r)}" for m, r in best.items()))
    (out / "best_rates.json").write_text(json.dumps(best, indent=2), encoding="utf-8")
    if not args.test_seeds:
        return
    chosen = {rate: [entries[m] for m in best if best[m] == rate] for rate in sorted(set(best.values()))}
    joined = []
    for seed in args.test_seeds:
        folders = []
        for rate, methods in chosen.items():
            folder = run_folder(out, "test", rate, seed)
            if seed == args.seed and not args.retrain_sweep_seed:
                rescore_on_test(run_folder(out, "valid", rate, seed), folder,
                                [m for m in best if best[m] == rate], False)
            else:
                run(finetune_command(args.recipe, folder, rate, seed, "test", args.overrides, methods, split_key),
                    folder, out, False, [m for m in best if best[m] == rate])
            read_summary(folder, "test")
            folders.append(folder)
        joined.append(Path("+".join(str(f) for f in folders)))
    print(f"\nTest {scored}, each method at its best validation rate, seeds {args.test_seeds}:")
    print("runs: " + " ".join(str(j) for j in joined) + "\n")
    try:
        print(comparison(joined, args.against))
    except UserError as error:
        raise SystemExit(f"error: {error.problem}; fix: {error.fix}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
