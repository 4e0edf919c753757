"""A run folder: ``recipe.yaml``, ``metrics.jsonl``, its lock, and the report written from that log.

:class:`RunFolder` is the one object both drivers of a run keep their folder through: the runner
(``ondevice-moe finetune``, every method in Flower's simulation) and, under ``flwr run``, the
ServerApp, so the folder is the same either way; ``eval``, ``export`` and ``generate`` open a finished
one with :meth:`RunFolder.read`. The report's summary, plots and ``report.md`` come from
:mod:`ondevice_moe.report`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from fnmatch import fnmatch
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from ondevice_moe import strict_yaml
from ondevice_moe.errors import UserError
from ondevice_moe.folder_lock import FolderBusy, folder_lock, live_holder
from ondevice_moe.methods.registry import reporters
from ondevice_moe.names import folder_name
from ondevice_moe.overrides import apply_override
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


FOLDER_FIX = "choose another --output folder, or pass --overwrite to replace the run in it"
LOCK = ".lock"

# What a run writes into its folder: what --overwrite removes (the .lock is the overwriting run's own).
RUN_OUTPUTS = ("recipe.yaml", "metrics.jsonl", "metrics.jsonl.tmp", "summary.json", "report.md", ".jobs.json",
               "plots", "checkpoints", "device_state", "flwr-*.log",
               "server_state", "federation.json", ".flower-run.json", "flwr.log",  # a run on real devices
               "tensorboard", "mlflow.db", "mlartifacts", "mlflow_runs.json")  # the trackers' (docs/tracking.md)


class RunFolder:
    """The folder of one run of ``recipe`` (``path``, by default ``runs/<recipe name>``) and its bookkeeping:
    which methods it keeps, its lock, its ``metrics.jsonl`` (:attr:`log`) and its report."""

    def __init__(self, recipe: Recipe, path: Path | None = None) -> None:
        self.recipe = recipe
        self.path = Path(path) if path else Path("runs") / recipe.name

    @cached_property
    def log(self) -> MetricsLog:
        """The folder's ``metrics.jsonl`` (opening it creates the folder: only once the inputs checked out)."""
        return MetricsLog(self.path / "metrics.jsonl")

    @classmethod
    def read(cls, path: Path, device: str | None = None, split: str | None = None) -> RunFolder:
        """A run folder on disk with the recipe its ``recipe.yaml`` holds (``device`` overrides
        ``model.device``, ``split`` ``data.eval_split`` or ``task.eval_split``); a folder that is not a
        run is a :class:`UserError`."""
        recipe_file = Path(path) / "recipe.yaml"
        if not recipe_file.is_file():
            raise UserError(f"{path} is not a run folder (no recipe.yaml)",
                            "pass the --output folder of a finetune run")
        raw = strict_yaml.read_mapping(recipe_file, "restore the run folder's recipe.yaml, or run finetune again")
        if device is not None:
            apply_override(raw, f"model.device={device}")
        if split is not None:
            section = "data" if raw.get("data") is not None else "task"  # a resolved recipe writes `data: null`
            if split == "valid" and section == "task" and not (raw.get("task") or {}).get("valid_examples"):
                raise UserError(f"--split valid scores the clients' validation split, and the run in {path} holds "
                                "none (its recipe has no task.valid_examples)", "drop --split, or use --split test")
            apply_override(raw, f"{section}.eval_split={split}")
        return cls(validate_recipe(raw, source=str(recipe_file)), path)

    def method_names(self) -> list[str]:
        return [self.recipe.method_name(index) for index in range(len(self.recipe.methods))]

    def finished(self) -> set[str]:
        """The methods whose ``done`` record is logged; a damaged log is a :class:`UserError`."""
        try:
            return self.log.finished()
        except CorruptLog as error:
            raise UserError(f"the run folder {self.path} is damaged: {error}",
                            "restore its metrics.jsonl, or run finetune again into a new folder") from None

    def kept(self, overwrite: bool = False) -> set[str]:
        """The finished methods that a run into this folder keeps (resumes past), read without writing
        anything: none for a new folder, or with ``overwrite`` (the run there is replaced). A folder that
        is a file or cannot be read, a damaged log, or a run of another recipe is a :class:`UserError`; a
        folder where nothing ran yet (its inputs failed their checks) takes any recipe."""
        if self.path.exists() and not self.path.is_dir():
            raise UserError(f"the run folder {self.path} is a file", "choose another --output folder")
        if overwrite or not self.path.is_dir():
            return set()
        recipe_file = self.path / "recipe.yaml"
        try:
            existing = recipe_file.read_text(encoding="utf-8") if recipe_file.exists() else None
            records = self.log.read()
        except (OSError, UnicodeDecodeError) as error:
            raise self._unusable(error) from None
        except CorruptLog as error:
            raise UserError(f"the run folder {self.path} is damaged: {error}", FOLDER_FIX) from None
        if records and existing is not None and not _same_recipe(existing, self.recipe):
            raise UserError(f"{self.path} holds a run of a different recipe (or other --set/--seed values)",
                            FOLDER_FIX)
        return {record["method"] for record in records if record["kind"] == "done"}

    def prepare(self, overwrite: bool = False) -> Path:
        """Create or reopen the folder (checked by :meth:`kept`) and write ``recipe.yaml``; ``overwrite``
        first removes what an earlier run wrote there (:data:`RUN_OUTPUTS`, nothing else). A log line cut
        short by a killed run is removed. Returns the folder's path."""
        self.kept(overwrite)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if overwrite:
                _remove_run_outputs(self.path)
            write_text(self.path / "recipe.yaml", _resolved(self.recipe))
            self.log.repair()
            self.log.path.touch()
        except (OSError, UnicodeDecodeError) as error:
            raise self._unusable(error) from None
        return self.path

    def held(self) -> AbstractContextManager[None]:
        """This process's hold on the folder while it runs (:func:`run_lock`)."""
        return run_lock(self.path)

    def restart_unfinished(self) -> list[int]:
        """The indices of the recipe's methods not finished (in an earlier, interrupted invocation, or
        never started), their records discarded: a simulated method cut short runs again from round 1."""
        finished, names = self.finished(), self.method_names()
        unfinished = [index for index, name in enumerate(names) if name not in finished]
        for index in unfinished:
            self.log.discard(names[index])
        return unfinished

    def failures(self, names: list[str]) -> list[str]:
        """Why each of ``names`` that has not finished did not: its last ``error`` record."""
        records, finished = self.log.read(), self.log.finished()
        failures = []
        for name in names:
            if name not in finished:
                errors = [r["message"] for r in records if r.get("method") == name and r["kind"] == "error"]
                failures.append(f"method '{name}' did not finish: {errors[-1] if errors else 'see the log above'}")
        return failures

    def where_stopped(self, names: list[str]) -> str:
        """Which of ``names`` a stop cut short, and after which of its rounds."""
        records, finished = self.log.read(), self.log.finished()
        for name in names:
            if name not in finished:
                rounds = [r["round"] for r in records if r.get("method") == name and r["kind"] == "round"]
                return f"during '{name}' after round {max(rounds, default=0)}"
        return "after the last method finished"

    def still_training(self) -> list[str]:
        """The methods a live ``finetune`` is still training here (none when no run holds the folder):
        ``eval`` scores only finished methods and says which it left out."""
        if live_holder(self.path / LOCK) is None:
            return []
        finished = self.log.finished()
        return [name for name in self.method_names() if name not in finished]

    def report(self) -> RunResult:
        """Summary, plots and ``report.md`` from the folder's ``metrics.jsonl``."""
        recipe, run_dir = self.recipe, self.path
        finished = self.log.finished()
        methods = [method for method in (recipe.method(index) for index in range(len(recipe.methods)))
                   if method.name in finished]  # a method that failed under `flwr run` reports its error instead
        records = self.log.read()
        names = [m.name for m in methods]
        families = reporters()
        summary = summarize(records, names, recipe.user_names, recipe.metric, eval_split(recipe), families)
        summary["seed"], summary["split_seed"] = recipe.seed, recipe.split_seed  # compare: the test's unit and n
        failed = {r["method"]: r["message"] for r in records
                  if r.get("kind") == "error" and r["method"] not in finished}
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

    def _unusable(self, error: OSError | UnicodeDecodeError) -> UserError:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        name = getattr(error, "filename", None) or self.path
        return UserError(f"cannot use the run folder {self.path}: {name}: {reason}", FOLDER_FIX)


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run folder for this process (:func:`~ondevice_moe.folder_lock.folder_lock` on ``.lock``)
    while it runs: a second ``finetune`` into the same folder is refused while the first lives; once its
    holder has ended, however it ended, the folder is free. A new folder is created."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"the run folder {run_dir} is a file", "choose another --output folder")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with folder_lock(run_dir / LOCK, {"pid": os.getpid()}):
            yield
    except FolderBusy as busy:
        raise UserError(f"another ondevice-moe run (pid {busy.holder.get('pid', '?')}) is writing to {run_dir}",
                        "wait for it to finish, or choose another --output folder") from None
    except OSError as error:
        raise UserError(f"cannot use the run folder {run_dir} ({error.strerror or error})",
                        "choose another --output folder") from None


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
    keep what that version did). The ``description`` is documentation, not part of the run: a recipe
    whose description was edited since resumes its runs. A file this version cannot read as a recipe is
    another recipe."""
    resolved = _resolved(_undescribed(recipe))
    try:
        raw = yaml.safe_load(existing)
        return isinstance(raw, dict) and _resolved(_undescribed(validate_recipe(raw))) == resolved
    except (yaml.YAMLError, UserError):
        return False


def _undescribed(recipe: Recipe) -> Recipe:
    """``recipe`` without its description, the one key that changes nothing a run computes."""
    return recipe.model_copy(update={"description": ""})


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
