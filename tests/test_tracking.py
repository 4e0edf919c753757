"""Tracking: TensorBoard and MLflow hold what metrics.jsonl holds, every step once; plain progress lines.

One real run of the tiny digits recipe through the command line, its output a pipe (no terminal),
with ``logging: {tensorboard: true, mlflow: true}``; the trackers are read back with their own
readers (TensorBoard's ``EventAccumulator``, ``MlflowClient`` on the run folder's local store).
"""

import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import yaml
from mlflow import MlflowClient
from mlflow.entities import ViewType
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ondevice_moe.errors import UserError
from ondevice_moe.recipe import validate_recipe
from ondevice_moe.report import MetricsLog
from ondevice_moe.run_folder import RunFolder
from ondevice_moe.tracking import LoggingSection, tracked_log
from ondevice_moe.tracking.progress import ProgressLines
from ondevice_moe.tracking.scalars import Scalar, scalars

ROOT = Path(__file__).parent.parent
TINY_DIGITS = Path(__file__).parent / "recipes" / "tiny-digits.yaml"
METHOD, ROUNDS, STEPS, DEVICES = "fed-ft", 2, 3, 4
OVERRIDES = ["logging.tensorboard=true", "logging.mlflow=true", "logging.wandb=true", f"methods=[{METHOD}]",
             "federation.local_epochs=null",
             f"federation.local_iterations={STEPS}", f"federation.rounds={ROUNDS}"]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """The run folder and the command's output (a pipe, 80 columns, as in a log file or CI)."""
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    command = [sys.executable, "-m", "ondevice_moe", "finetune", str(TINY_DIGITS), "--output", str(run_dir)]
    for override in OVERRIDES:
        command += ["--set", override]
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "COLUMNS": "80"}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir, result.stdout


def _records(run_dir: Path) -> list[dict]:
    return [r for r in MetricsLog(run_dir / "metrics.jsonl").read() if r["method"] == METHOD]


def _curves(points: list[Scalar]) -> dict[str, list[tuple[int, float]]]:
    curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for point in points:
        curves[point.tag].append((point.step, point.value))
    return {tag: sorted(values) for tag, values in curves.items()}


def _expected(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    return _curves([point for record in _records(run_dir) for point in scalars(record, every_step=True)])


def _tensorboard(folder: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: sorted((event.step, event.value) for event in events.Scalars(tag))
            for tag in events.Tags()["scalars"]}


def _mlflow_runs(run_dir: Path, view: int = ViewType.ACTIVE_ONLY) -> tuple[MlflowClient, list]:
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tiny-digits")
    return client, client.search_runs([experiment.experiment_id], run_view_type=view)


def _mlflow_curves(client: MlflowClient, run_id: str, tags: list[str]) -> dict[str, list[tuple[int, float]]]:
    return {tag: sorted((metric.step, metric.value) for metric in client.get_metric_history(run_id, tag))
            for tag in tags}


def test_every_step_of_every_device_is_logged_once_in_order(tracked_run):
    run_dir, _ = tracked_run
    trains = [r for r in _records(run_dir) if r["kind"] == "train"]
    assert sum(len(r["step_losses"]) for r in trains) == STEPS * DEVICES * ROUNDS
    for user in {r["user"] for r in trains}:
        mine = sorted((r for r in trains if r["user"] == user), key=lambda r: r["round"])
        assert [r["iteration"] for r in mine] == [STEPS * k for k in range(1, ROUNDS + 1)]
        assert all(r["train_loss"] == pytest.approx(np.mean(r["step_losses"])) for r in mine)
        assert all(len(r["step_lrs"]) == len(r["step_grad_norms"]) == STEPS for r in mine)


def test_each_step_logs_its_learning_rate_and_gradient_norm(tracked_run):
    """The recipe's rate as the schedule set it (tiny-digits: constant) and a positive, finite, moving norm."""
    run_dir, _ = tracked_run
    recipe = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    stored = _tensorboard(run_dir / "tensorboard" / METHOD)
    user = next(r["user"] for r in _records(run_dir) if r["kind"] == "train")
    rates = [value for _, value in stored[f"step/lr/{user}"]]
    norms = [value for _, value in stored[f"step/grad_norm/{user}"]]
    assert len(rates) == len(norms) == STEPS * ROUNDS
    assert rates == pytest.approx([recipe["training"]["lr"]] * len(rates))
    assert all(np.isfinite(norms)) and min(norms) > 0 and len(set(norms)) > 1


def test_tensorboard_holds_every_scalar_of_the_metrics_log(tracked_run):
    run_dir, _ = tracked_run
    expected = _expected(run_dir)
    stored = _tensorboard(run_dir / "tensorboard" / METHOD)
    assert stored == {tag: [(step, float(np.float32(value))) for step, value in curve]  # TensorBoard keeps float32
                      for tag, curve in expected.items()}
    first = next(r for r in _records(run_dir) if r["kind"] == "train" and r["round"] == 1)
    assert stored[f"step/train_loss/{first['user']}"][:STEPS] == [
        (step, float(np.float32(loss))) for step, loss in enumerate(first["step_losses"], start=1)]
    last_eval = next(r for r in _records(run_dir) if r["kind"] == "eval" and r["round"] == ROUNDS)
    assert (ROUNDS, float(np.float32(last_eval["score"]))) in stored[f"eval/score/{last_eval['user']}"]


def test_the_mlflow_run_holds_every_scalar_of_the_metrics_log(tracked_run):
    run_dir, _ = tracked_run
    expected = _expected(run_dir)
    client, runs = _mlflow_runs(run_dir)
    assert [(run.info.run_name, run.info.status) for run in runs] == [(METHOD, "FINISHED")]
    run = runs[0]
    assert set(run.data.metrics) == set(expected)
    assert _mlflow_curves(client, run.info.run_id, list(expected)) == expected  # exact: MLflow keeps doubles
    assert run.data.params["federation.rounds"] == str(ROUNDS) and run.data.params["seed"] == "0"
    assert [artifact.path for artifact in client.list_artifacts(run.info.run_id)] == ["recipe.yaml"]


def _wandb_records(path: Path):
    """The records of an offline W&B run file: W&B's LevelDB-style log (a 7-byte file header, 32 KiB blocks of
    records, each a 7-byte header and a protobuf ``Record``, long ones in pieces)."""
    from wandb.proto import wandb_internal_pb2

    data, position, block, pending = path.read_bytes(), 7, 32768, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        payload, position = data[position + 7:position + 7 + length], position + 7 + length
        pending = payload if kind in (1, 2) else pending + payload  # full or first piece; middle or last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def test_the_offline_wandb_run_holds_every_scalar_of_the_metrics_log(tracked_run):
    run_dir, _ = tracked_run
    [run_file] = (run_dir / "wandb" / METHOD / "wandb").glob("offline-run-*/run-*.wandb")
    curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
    config = {}
    for record in _wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for tag, value in row.items():
                if "/" in tag:
                    curves[tag].append((row["device_step" if tag.startswith("step/") else "round"], float(value)))
        elif record.WhichOneof("record_type") == "run":
            config = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                      for item in record.run.config.update}
    assert {tag: sorted(curve) for tag, curve in curves.items()} == _expected(run_dir)
    assert config["federation.rounds"] == str(ROUNDS)


def test_a_resumed_method_replaces_its_earlier_attempt_in_both_trackers(tracked_run, tmp_path):
    run_dir, _ = tracked_run
    moved = shutil.copytree(run_dir, tmp_path / "moved")  # a run folder resumes wherever it was moved to
    records = _records(moved)
    expected = _expected(moved)
    log = MetricsLog(moved / "metrics.jsonl")

    def attempt(killed_in_round: int | None) -> None:
        log.discard(METHOD)  # what the runner does before a method cut short runs again from round 1
        with tracked_log(log.path, LoggingSection(tensorboard=True, mlflow=True), "tiny-digits", METHOD,
                         {}) as tracked:
            for record in records:
                if killed_in_round is not None and record.get("round") == killed_in_round:
                    raise RuntimeError(f"killed in round {killed_in_round}")
                tracked.write(record)

    with pytest.raises(RuntimeError):
        attempt(killed_in_round=2)
    attempt(killed_in_round=None)
    assert _tensorboard(moved / "tensorboard" / METHOD) == {
        tag: [(step, float(np.float32(value))) for step, value in curve] for tag, curve in expected.items()}
    client, runs = _mlflow_runs(moved)
    assert [(run.info.run_name, run.info.status) for run in runs] == [(METHOD, "FINISHED")]
    assert _mlflow_curves(client, runs[0].info.run_id, list(expected)) == expected
    _, deleted = _mlflow_runs(moved, ViewType.DELETED_ONLY)
    assert sorted(run.info.status for run in deleted) == ["FAILED", "FINISHED"]  # the cut-short one, the first


def test_an_earlier_run_the_store_no_longer_holds_is_not_in_the_way_and_settings_become_params(tracked_run, tmp_path):
    moved = shutil.copytree(tracked_run[0], tmp_path / "moved")
    (moved / "mlflow_runs.json").write_text(json.dumps({METHOD: "0" * 32}))  # e.g. deleted with `mlflow gc`
    settings = {"seed": 7, "description": "x" * 7000, "training": {"betas": [0.9, 0.95]},
                "methods": [{"name": METHOD}]}
    with tracked_log(moved / "metrics.jsonl", LoggingSection(mlflow=True), "tiny-digits", METHOD,
                     settings) as tracked:
        tracked.write(_records(moved)[0])
    _, runs = _mlflow_runs(moved)  # newest first
    assert sorted(run.info.status for run in runs) == ["FINISHED", "FINISHED"]  # the first run's, and this one
    assert json.loads((moved / "mlflow_runs.json").read_text())[METHOD] == runs[0].info.run_id  # the newest
    # Scalars and lists of scalars as parameters; a text over MLflow's 6,000 characters and the method entries
    # only in recipe.yaml.
    assert runs[0].data.params == {"seed": "7", "training.betas": "[0.9, 0.95]"}


def test_overwrite_removes_what_the_trackers_wrote_into_the_run_folder(tracked_run, tmp_path):
    moved = shutil.copytree(tracked_run[0], tmp_path / "moved")
    written = ["tensorboard", "mlflow.db", "mlartifacts", "mlflow_runs.json"]
    assert all((moved / name).exists() for name in written)
    RunFolder(validate_recipe(yaml.safe_load((moved / "recipe.yaml").read_text())), moved).prepare(overwrite=True)
    assert not [name for name in written if (moved / name).exists()]


def test_the_report_draws_the_loss_curves(tracked_run):
    run_dir, _ = tracked_run
    assert (run_dir / "plots" / "loss_curves.png").stat().st_size > 0
    assert "![loss_curves](plots/loss_curves.png)" in (run_dir / "report.md").read_text()


def test_plain_output_prints_a_whole_line_per_round_as_it_ends(tracked_run):
    _, output = tracked_run
    rounds = [line for line in output.splitlines() if line.startswith(f"  {METHOD} ")]
    assert [line.split(":")[0].strip() for line in rounds] == [f"{METHOD} {k}/{ROUNDS}" for k in
                                                               range(1, ROUNDS + 1)]
    assert all("mean score" in line and "elapsed 0:" in line for line in rounds)
    assert "eta 0:" in rounds[0] and "eta" not in rounds[-1]  # an estimate while rounds remain
    assert [line for line in output.splitlines() if line.startswith("[1/1]")] == [  # no progress bars in a log
        next(line for line in output.splitlines() if line.startswith(f"[1/1] {METHOD}: starting (elapsed 0:"))]
    assert "…" not in output and "upload / round (all devices)" in output  # nothing cut or wrapped at 80 columns


def test_progress_lines_estimate_the_time_left_from_the_rounds_so_far():
    now = [100.0]
    lines = ProgressLines(clock=lambda: now[0])
    now[0] = 130.0
    assert lines.method("comigs-1GXs-2444", 1, 3) == "[2/3] comigs-1GXs-2444: starting (elapsed 0:00:30)"
    now[0] = 150.0  # the first of 5 rounds took 20 s: 4 rounds, 80 s, to go
    assert lines.round(1, 5, "round 1, mean score 40.00") == (
        "  comigs-1GXs-2444 1/5: round 1, mean score 40.00 (elapsed 0:00:50, comigs-1GXs-2444 eta 0:01:20)")
    now[0] = 230.0
    assert lines.round(5, 5, "round 5").endswith("(elapsed 0:02:10)")


def test_a_record_gives_its_numbers_as_scalars_and_its_steps_on_the_devices_count():
    record = {"method": "m", "kind": "train", "round": 2, "user": "a+b", "device": 1, "train_loss": 1.5,
              "iteration": 6.0, "step_losses": [2.0, 1.0, 1.5], "final": True, "phase": "train"}
    assert scalars(record, every_step=True) == [
        Scalar("train/iteration/a_b", 2, 6.0), Scalar("train/train_loss/a_b", 2, 1.5),
        Scalar("step/train_loss/a_b", 4, 2.0), Scalar("step/train_loss/a_b", 5, 1.0),
        Scalar("step/train_loss/a_b", 6, 1.5)]
    assert [point.tag for point in scalars(record, every_step=False)] == ["train/iteration/a_b", "train/train_loss/a_b"]
    for malformed in ({"iteration": 1e300}, {"iteration": 2.0}, {"iteration": float("nan")}):  # a lying device's
        assert [point.tag for point in scalars(record | malformed, every_step=True)] == [
            "train/iteration/a_b", "train/train_loss/a_b"]  # no steps it cannot say
    assert scalars({"method": "m", "kind": "comm", "round": 3, "bytes_up": 10}, True) == [
        Scalar("comm/bytes_up", 3, 10.0)]
    assert scalars({"method": "m", "kind": "done", "rounds": 3}, True) == []


def test_an_mlflow_uri_without_mlflow_is_one_clear_error():
    raw = yaml.safe_load(TINY_DIGITS.read_text()) | {"logging": {"mlflow_uri": "sqlite:///x.db"}}
    with pytest.raises(UserError) as caught:
        validate_recipe(raw)
    assert "logging.mlflow is false" in str(caught.value) and "mlflow: true" in str(caught.value)


@pytest.mark.parametrize(("setting", "module"), [("tensorboard", "tensorboard"), ("mlflow", "mlflow"),
                                                 ("wandb", "wandb")])
def test_a_tracker_whose_package_is_missing_names_the_extra(tmp_path, monkeypatch, setting, module):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    section = LoggingSection(**{setting: True})
    with pytest.raises(UserError) as error, tracked_log(tmp_path / "metrics.jsonl", section, "e", "m", {}):
        pass
    assert f"logging.{setting} needs {module}" in str(error.value) and "ondevice-moe[tracking]" in error.value.fix
