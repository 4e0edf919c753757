"""Experiment trackers that take a method's scalars as the server logs them.

Each sink holds one method of one run folder and starts clean: the files or the run of an
earlier attempt at that method (a run cut short, which resumes from round 1 and has its records
in ``metrics.jsonl`` discarded) are removed first, so no step is logged twice.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from ondevice_moe.tracking.scalars import Scalar

MLFLOW_BATCH = 1000  # MLflow's most metrics per log_batch call
MLFLOW_PARAMS_BATCH = 100  # ... and most parameters
MLFLOW_PARAM_LENGTH = 6000  # MLflow's longest parameter value
METHOD_TAG = "ondevice_moe.method"
FOLDER_TAG = "ondevice_moe.run_folder"
MLFLOW_RUNS = "mlflow_runs.json"  # in the run folder: method → its MLflow run id
WANDB_AXES = {"step": "device_step", "round": "round"}  # a W&B curve's x axis, by the kind of its tag


class Sink(Protocol):
    """A tracker of one method's curves."""

    def add(self, points: list[Scalar]) -> None: ...

    def close(self, failed: bool) -> None: ...


class TensorBoardSink:
    """TensorBoard event files in ``folder`` (``tensorboard --logdir`` on its parent shows each method as a run).
    Values are stored as TensorBoard stores them, in float32."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        shutil.rmtree(folder, ignore_errors=True)
        self.writer = SummaryWriter(log_dir=str(folder))

    def add(self, points: list[Scalar]) -> None:
        for point in points:
            self.writer.add_scalar(point.tag, point.value, point.step)
        self.writer.flush()  # a TensorBoard watching the run sees each round as it ends

    def close(self, failed: bool) -> None:
        self.writer.close()


class MlflowSink:
    """One MLflow run named ``run`` in ``experiment`` at ``uri``, tagged with its run folder and method,
    with the ``settings``' scalars as parameters (:func:`flat_settings`) and the run folder's
    ``recipe.yaml`` as an artifact. ``artifacts``: where a new experiment keeps its artifacts (a local
    store's own folder; ``None``: the tracking server's choice). The run folder's ``mlflow_runs.json``
    names each method's run, so that a new attempt deletes the earlier one's, wherever the folder moved."""

    def __init__(self, uri: str, experiment: str, run: str, run_folder: Path, settings: Mapping[str, Any],
                 artifacts: str | None) -> None:
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        experiment_id = self._experiment(experiment, artifacts)
        ledger = run_folder / MLFLOW_RUNS
        runs = json.loads(ledger.read_text(encoding="utf-8")) if ledger.is_file() else {}
        if run in runs:
            self._delete(runs[run])
        self.run_id = self.client.create_run(experiment_id, run_name=run, tags={
            METHOD_TAG: run, FOLDER_TAG: str(run_folder.resolve())}).info.run_id
        ledger.write_text(json.dumps({**runs, run: self.run_id}, indent=2), encoding="utf-8")
        self._describe(settings, run_folder / "recipe.yaml")

    def _experiment(self, name: str, artifacts: str | None) -> str:
        """The id of the experiment called ``name``: made if new, restored if deleted."""
        found = self.client.get_experiment_by_name(name)
        if found is None:
            return self.client.create_experiment(name, artifact_location=artifacts)
        if found.lifecycle_stage == "deleted":
            self.client.restore_experiment(found.experiment_id)
        return found.experiment_id

    def _describe(self, settings: Mapping[str, Any], recipe: Path) -> None:
        """The settings' scalars as the run's parameters (a text too long for MLflow, say a long description,
        only in the artifact), the recipe file as its artifact."""
        from mlflow.entities import Param

        params = [Param(key, value) for key, value in flat_settings(settings).items()
                  if len(value) <= MLFLOW_PARAM_LENGTH]
        for start in range(0, len(params), MLFLOW_PARAMS_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + MLFLOW_PARAMS_BATCH])
        if recipe.is_file():
            self.client.log_artifact(self.run_id, str(recipe))

    def _delete(self, run_id: str) -> None:
        """Delete an earlier attempt's run, unless the store no longer has it."""
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

        try:
            self.client.delete_run(run_id)
        except MlflowException as error:
            if error.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
                raise

    def add(self, points: list[Scalar]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(point.tag, point.value, now, point.step) for point in points]
        for start in range(0, len(metrics), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MLFLOW_BATCH])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class WandbSink:
    """One Weights & Biases run named ``run`` in project ``project``, its files under ``folder`` (cleared first:
    an earlier attempt's files go), the ``settings``' scalars as its config. ``mode`` ``offline`` (the default)
    needs no network or account: ``wandb sync FOLDER/wandb/offline-run-*`` uploads the run later. Each curve
    keeps its own x axis, as in the other trackers: a ``step/`` curve the device's step count
    (``device_step``), every other curve the round (``round``)."""

    def __init__(self, folder: Path, project: str, run: str, settings: Mapping[str, Any], mode: str) -> None:
        import wandb

        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        self.run = wandb.init(project=project, name=run, dir=str(folder), mode=mode, config=flat_settings(settings),
                              reinit="create_new", settings=wandb.Settings(silent=True, console="off"))
        for axis in WANDB_AXES.values():
            self.run.define_metric(axis, hidden=True)
        self.defined: set[str] = set()

    def add(self, points: list[Scalar]) -> None:
        for point in points:
            axis = WANDB_AXES["step" if point.tag.startswith("step/") else "round"]
            if point.tag not in self.defined:
                self.run.define_metric(point.tag, step_metric=axis)
                self.defined.add(point.tag)
            self.run.log({point.tag: point.value, axis: point.step})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def flat_settings(settings: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The scalar settings of a nested mapping (a resolved recipe) as ``section.key: value``; a list of
    scalars (AdamW's betas) as its text; lists of mappings (users, methods) are left to ``recipe.yaml``."""
    flat: dict[str, str] = {}
    for key, value in settings.items():
        if isinstance(value, Mapping):
            flat.update(flat_settings(value, f"{prefix}{key}."))
        elif not isinstance(value, list) or not any(isinstance(item, Mapping | list) for item in value):
            flat[f"{prefix}{key}"] = str(value)
    return flat
