"""A run folder: ``recipe.yaml``, ``metrics.jsonl`` and the report written from that log.

Both drivers of a run keep their folder through these functions: the runner
(``ondevice-moe finetune``, every method in Flower's simulation) and, under ``flwr run``, the
ServerApp (one method), so the folder is the same either way. The report's summary, plots and
``report.md`` come from :mod:`ondevice_moe.report`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import yaml

from ondevice_moe.errors import UserError
from ondevice_moe.methods.registry import reporters
from ondevice_moe.names import folder_name
from ondevice_moe.recipe import Recipe, validate_recipe
from ondevice_moe.report import (
    CorruptLog,
    MetricsLog,
    plot_communication,
    plot_expert_scores,
    plot_loss_curves,
    plot_rounds,
    summarize,
    write_report,
)
from ondevice_moe.safe_files import write_text
from ondevice_moe.versions import versions


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    report: Path


def run_dir_of(recipe: Recipe, output: Path | None) -> Path:
    """The run folder of ``recipe``: ``output``, by default ``runs/<recipe name>``."""
    return Path(output) if output else Path("runs") / recipe.name


FOLDER_FIX = "choose another --output folder, or pass --overwrite to replace the run in it"


def kept_methods(recipe: Recipe, run_dir: Path, overwrite: bool = False) -> set[str]:
    """The finished methods that a run of ``recipe`` into ``run_dir`` keeps (resumes past), read without
    writing anything: none for a new folder, or with ``overwrite`` (the run there is replaced). A folder that
    is a file or cannot be read, a damaged log, or a run of another recipe is a :class:`UserError`; a folder
    where nothing ran yet (its inputs failed their checks) takes any recipe."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"the run folder {run_dir} is a file", "choose another --output folder")
    if overwrite or not run_dir.is_dir():
        return set()
    recipe_file = run_dir / "recipe.yaml"
    try:
        existing = recipe_file.read_text(encoding="utf-8") if recipe_file.exists() else None
        records = MetricsLog(run_dir / "metrics.jsonl").read()
    except (OSError, UnicodeDecodeError) as error:
        raise _unusable(run_dir, error) from None
    except CorruptLog as error:
        raise UserError(f"the run folder {run_dir} is damaged: {error}", FOLDER_FIX) from None
    if records and existing is not None and not _same_recipe(existing, recipe):
        raise UserError(f"{run_dir} holds a run of a different recipe (or other --set/--seed values)", FOLDER_FIX)
    return {record["method"] for record in records if record["kind"] == "done"}


def prepare_run_dir(recipe: Recipe, output: Path | None, overwrite: bool = False) -> Path:
    """Create or reopen the run folder (checked by :func:`kept_methods`) and write ``recipe.yaml``;
    ``overwrite`` first removes what an earlier run wrote there (:data:`RUN_OUTPUTS`, nothing else).
    A log line cut short by a killed run is removed."""
    run_dir = run_dir_of(recipe, output)
    kept_methods(recipe, run_dir, overwrite)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if overwrite:
            _remove_run_outputs(run_dir)
        write_text(run_dir / "recipe.yaml", _resolved(recipe))
        log = MetricsLog(run_dir / "metrics.jsonl")
        log.repair()
        log.path.touch()
    except (OSError, UnicodeDecodeError) as error:
        raise _unusable(run_dir, error) from None
    return run_dir


# What a run writes into its folder: what --overwrite removes (the .lock is the overwriting run's own).
RUN_OUTPUTS = ("recipe.yaml", "metrics.jsonl", "metrics.jsonl.tmp", "summary.json", "report.md", ".jobs.json",
               "plots", "checkpoints", "device_state", "flwr-*.log",
               "server_state", "federation.json", ".flower-run.json", "flwr.log",  # a run on real devices
               "tensorboard", "mlflow.db", "mlartifacts", "mlflow_runs.json")  # the trackers' (docs/tracking.md)


def _remove_run_outputs(run_dir: Path) -> None:
    """Remove the files and folders of :data:`RUN_OUTPUTS` from ``run_dir``: a link as a link, never followed."""
    for path in run_dir.iterdir():
        if not any(fnmatch(path.name, pattern) for pattern in RUN_OUTPUTS):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _resolved(recipe: Recipe) -> str:
    """The recipe as ``recipe.yaml`` holds it: every default filled in."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def _same_recipe(existing: str, recipe: Recipe) -> bool:
    """Whether the ``recipe.yaml`` a folder's run started with is ``recipe``: the same text or, written by
    an earlier version of the toolkit, the same once the keys added since take their defaults (which
    keep what that version did). A file this version cannot read as a recipe is another recipe."""
    resolved = _resolved(recipe)
    if existing == resolved:
        return True
    try:
        raw = yaml.safe_load(existing)
        return isinstance(raw, dict) and _resolved(validate_recipe(raw)) == resolved
    except (yaml.YAMLError, UserError):
        return False


def _unusable(run_dir: Path, error: OSError | UnicodeDecodeError) -> UserError:
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    name = getattr(error, "filename", None) or run_dir
    return UserError(f"cannot use the run folder {run_dir}: {name}: {reason}", FOLDER_FIX)


def start_method(recipe: Recipe, run_dir: Path, method: str) -> None:
    """Prepare the run folder for one method run by ``flwr run`` and drop the method's old records."""
    prepare_run_dir(recipe, run_dir)
    MetricsLog(run_dir / "metrics.jsonl").discard(method)


def finish_report(recipe: Recipe, run_dir: Path) -> RunResult:
    """Summary, plots and ``report.md`` from the run folder's ``metrics.jsonl``."""
    log = MetricsLog(run_dir / "metrics.jsonl")
    finished = log.finished()
    methods = [method for method in (recipe.method(index) for index in range(len(recipe.methods)))
               if method.name in finished]  # a method that failed under `flwr run` reports its error instead
    records = log.read()
    names = [m.name for m in methods]
    families = reporters()
    summary = summarize(records, names, recipe.user_names, recipe.metric, eval_split(recipe), families)
    summary["seed"], summary["split_seed"] = recipe.seed, recipe.split_seed  # compare: the test's unit and n
    failed = {r["method"]: r["message"] for r in records if r.get("kind") == "error" and r["method"] not in finished}
    plots = [p for p in (plot_rounds(records, names, run_dir / "plots" / "rounds.png"),
                         plot_loss_curves(records, names, run_dir / "plots" / "loss_curves.png"),
                         plot_communication(records, names, run_dir / "plots" / "communication.png")) if p]
    for method in methods:
        if method.procedure.routers != "none":  # only learned routers have scores worth a plot
            picture = run_dir / "plots" / f"expert_scores_{folder_name(method.name)}.png"
            plot = plot_expert_scores(records, method.name, picture)
            if plot:
                plots.append(plot)
    facts = run_facts(recipe, summary) + [f"did not finish: {name} ({message})" for name, message in failed.items()]
    report = write_report(run_dir, recipe.name, summary, plots, facts, families)
    return RunResult(run_dir, summary, report)


def eval_split(recipe: Recipe) -> str:
    """The split a run's users are scored on: ``data.eval_split`` or ``task.eval_split``."""
    if recipe.data is not None:
        return recipe.data.eval_split
    return recipe.task.eval_split if recipe.task is not None else "test"


def run_facts(recipe: Recipe, summary: dict[str, Any]) -> list[str]:
    """What a reader of ``report.md`` needs to know of the run before its numbers: seeds,
    rounds, devices, when the report was written, with which versions, and dropped updates."""
    dropped = sum(count for method in summary["methods"].values() for count in method.get("dropped", {}).values())
    return [f"seed {recipe.seed} (data seed {recipe.split_seed}), {recipe.federation.rounds} rounds, "
            f"{len(recipe.user_names)} devices, model {recipe.model.name}",
            f"written {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')} with "
            + ", ".join(f"{package} {version}" for package, version in versions().items()),
            "dropped updates: " + (f"{dropped} (see Dropped devices below)" if dropped else "none")]
