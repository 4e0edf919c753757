"""Crafted and careless input gets one clear message (problem and fix), never a traceback, a hang
or a silently wrong run: recipes (YAML aliases, duplicate keys, object tags, impossible numbers),
data files (FIFOs, null texts, oversized CSV fields) and run folders. Paths and names are in
tests/test_devices.py (names), tests/test_export.py (--force) and tests/test_resume.py (the lock);
lying devices in tests/test_lying_devices.py."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ondevice_moe.cli import app
from ondevice_moe.data.sources import documents
from ondevice_moe.data.tasks import UserTaskFile, load_task, user_task
from ondevice_moe.errors import UserError
from ondevice_moe.recipe import load_recipe, validate_recipe

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
runner = CliRunner()


def _dry_run(recipe: Path) -> tuple[int, str]:
    result = runner.invoke(app, ["finetune", str(recipe), "--dry-run"])
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize(("text", "expected"), [
    ("a: &x [1, 2]\nb: &y [*x, *x]\nc: [*y, *y]\n", "the alias *x is not allowed"),
    ("name: tiny\nname: other\n", "the key 'name' appears twice"),
    ("data_seed: !!python/object/apply:os.system [touch pwned]\n", "could not determine a constructor"),
])
def test_a_crafted_recipe_is_one_message_and_runs_nothing(tmp_path, monkeypatch, text, expected):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "crafted.yaml"
    recipe.write_text(text if "&x" in text else TINY.read_text() + "\n" + text)
    code, output = _dry_run(recipe)
    assert code == 2 and expected in output and "Traceback" not in output
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(("change", "expected"), [
    ({"seed": -1}, "seed"), ({"seed": 10**30}, "seed"),
    ({"data": {"users": [{"name": "code", "source": "python-code", "weight": float("inf")}]}}, "weight"),
    ({"federation": {"cpus_per_client": 1e-5}}, "cpus_per_client"),
    ({"federation": {"faults": [{"device": 99, "kind": "crash"}]}}, "names device 99"),
    ({"federation": {"faults": [{"device": 0, "kind": "crash", "rounds": [0, -3, 999]}]}}, "rounds [-3, 0, 999]"),
    ({"federation": {"secure_aggregation": "secaggplus", "clients_per_round": 1}, "methods": ["fedavg"]},
     "at least 2 devices a round"),
])
def test_impossible_numbers_are_refused_when_the_recipe_is_read(change, expected):
    raw = yaml.safe_load(TINY.read_text())
    for key, value in change.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and key in raw else value
    with pytest.raises(UserError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        validate_recipe(raw)


def test_a_label_column_among_the_text_columns_is_refused(tmp_path):
    raw = yaml.safe_load((TINY.parent / "tiny-classification.yaml").read_text())
    data = tmp_path / "mine.csv"
    data.write_text("text,label\ngood,pos\nbad,neg\n")
    raw["task"] = {"name": "mine", "path": str(data), "labels": ["neg", "pos"], "text_columns": ["label"]}
    with pytest.raises(UserError, match="would read the answer"):
        validate_recipe(raw)


def test_a_null_or_numeric_text_is_refused_not_read_as_words(tmp_path):
    lines = tmp_path / "texts.jsonl"
    lines.write_text('{"text": "fine"}\n{"text": null}\n')
    with pytest.raises(UserError, match=r"texts.jsonl, row 2: 'text' is null, not text"):
        list(documents("jsonl", {"path": str(lines)}))
    lines.write_text('{"text": 7}\n')
    with pytest.raises(UserError, match="is a number, not text"):
        list(documents("jsonl", {"path": str(lines)}))


def test_a_fifo_as_data_is_refused_instead_of_blocking(tmp_path):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    outcome = {}

    def read():
        try:
            list(documents("jsonl", {"path": str(fifo)}))
        except UserError as error:
            outcome["error"] = error.problem

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the reader before failing, so the test run does not hang
        with open(fifo, "w"):
            pass
    assert "is not a regular file or folder" in outcome.get("error", "blocked on the FIFO")


def test_an_oversized_csv_field_is_read_whole(tmp_path):
    data = tmp_path / "big.csv"
    data.write_text("text,label\n" + "x" * 200_000 + ",pos\n" + "short,neg\n" * 9)
    task = user_task("big", ["neg", "pos"], UserTaskFile(data, ("text",), "label"))
    texts = load_task(task, "train").texts + load_task(task, "test").texts
    assert ("x" * 200_000,) in texts  # datasets reads CSV through pandas, which has no field-size limit


def test_a_run_folder_with_a_crafted_recipe_is_one_message(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text("name: x\nname: y\n")
    result = runner.invoke(app, ["eval", str(run)])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and "appears twice" in output and "Traceback" not in output


def test_bundled_recipes_still_load():
    for recipe in sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml")):
        load_recipe(recipe)


@pytest.mark.parametrize("log", ["not json at all\n", '{"kind": "done"}\n'])
def test_a_run_folder_with_a_damaged_log_is_one_message(tmp_path, log):
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(TINY.read_text())
    (run / "metrics.jsonl").write_text(log)
    result = runner.invoke(app, ["eval", str(run)])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and "is not a metrics record" in output and "Traceback" not in output


def _model_folder(root: Path, weights: str, content: bytes) -> Path:
    folder = root / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}')
    (folder / weights).write_bytes(content)
    return folder


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_weights_never_run_and_are_one_message(tmp_path):
    import pickle

    marker = tmp_path / "EXECUTED"
    folder = _model_folder(tmp_path, "pytorch_model.bin", pickle.dumps(_Payload(marker)))
    result = runner.invoke(app, ["finetune", str(TINY), "--set", f"model.name={folder}", "--set",
                                 "methods=[pretrained]", "--output", str(tmp_path / "out")])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and "holds pickled weights that would run code" in output
    assert "weights_only=False" not in output and not marker.exists()


def test_a_corrupt_safetensors_model_is_one_message(tmp_path):
    folder = _model_folder(tmp_path, "model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}")
    result = runner.invoke(app, ["finetune", str(TINY), "--set", f"model.name={folder}", "--set",
                                 "methods=[pretrained]", "--output", str(tmp_path / "out")])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and f"cannot load model '{folder}'" in output and "Traceback" not in output
