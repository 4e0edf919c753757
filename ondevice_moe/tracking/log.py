"""``metrics.jsonl`` for one method's server, handing each record to the recipe's trackers as well.

``metrics.jsonl`` stays the source of truth: a record is written there first, then its scalars
(:func:`~ondevice_moe.tracking.scalars.scalars`) go to each tracker.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ondevice_moe.extras import require
from ondevice_moe.names import folder_name
from ondevice_moe.report import MetricsLog
from ondevice_moe.tracking.scalars import scalars
from ondevice_moe.tracking.section import LoggingSection
from ondevice_moe.tracking.sinks import MlflowSink, Sink, TensorBoardSink, WandbSink

TENSORBOARD_FOLDER = "tensorboard"
MLFLOW_DATABASE = "mlflow.db"
MLFLOW_ARTIFACTS = "mlartifacts"
WANDB_FOLDER = "wandb"


class TrackedLog(MetricsLog):
    """A :class:`MetricsLog` whose every written record also feeds ``sinks``."""

    def __init__(self, path: Path, sinks: list[Sink], every_step: bool) -> None:
        super().__init__(path)
        self.sinks = sinks
        self.every_step = every_step

    def write(self, record: dict[str, Any]) -> None:
        super().write(record)
        points = scalars(record, self.every_step)
        if points:
            for sink in self.sinks:
                sink.add(points)


@contextmanager
def tracked_log(path: Path, section: LoggingSection, experiment: str, run: str,
                settings: Mapping[str, Any]) -> Iterator[MetricsLog]:
    """The log at ``path`` (a run folder's ``metrics.jsonl``) for method ``run`` of recipe ``experiment``:
    plain when ``section`` turns no tracker on, else feeding TensorBoard (``<run folder>/tensorboard/<run>``)
    and MLflow (``section.mlflow_uri``, default ``sqlite:///<run folder>/mlflow.db`` with artifacts in
    ``<run folder>/mlartifacts``; the ``settings``, the resolved recipe, become the run's parameters).
    On leaving, the trackers are closed, an MLflow run marked FAILED when the method raised."""
    if not section.enabled:
        yield MetricsLog(path)
        return
    run_folder = path.parent
    for module, wanted in (("tensorboard", section.tensorboard), ("mlflow", section.mlflow), ("wandb", section.wandb)):
        if wanted:
            require(module, f"logging.{module}")
    sinks: list[Sink] = []
    if section.tensorboard:
        sinks.append(TensorBoardSink(run_folder / TENSORBOARD_FOLDER / folder_name(run)))
    if section.mlflow:
        local = section.mlflow_uri is None
        uri = f"sqlite:///{(run_folder / MLFLOW_DATABASE).resolve()}" if local else section.mlflow_uri
        artifacts = (run_folder / MLFLOW_ARTIFACTS).resolve().as_uri() if local else None
        sinks.append(MlflowSink(uri, experiment, run, run_folder, settings, artifacts))
    if section.wandb:
        sinks.append(WandbSink(run_folder / WANDB_FOLDER / folder_name(run), section.wandb_project or experiment, run,
                               settings, section.wandb_mode))
    failed = True
    try:
        yield TrackedLog(path, sinks, section.every_step)
        failed = False
    finally:
        for sink in sinks:
            sink.close(failed)
