"""Crafted and careless input gets one clear message (problem and fix), never a traceback, a hang
or a silently wrong run: recipes (YAML aliases, duplicate keys, object tags, impossible numbers),
data files (FIFOs, null texts, oversized CSV fields) and run folders. Paths and names are in
tests/test_devices.py (names), tests/test_export.py (--force) and tests/test_resume.py (the lock);
lying devices in tests/test_lying_devices.py."""

from __future__ import annotations

import os
import re
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


# -- issue 62: bounds before allocation, files that block, nesting, links -------------------------------


@pytest.mark.parametrize(("change", "expected"), [
    ({"data": {"clients": 10**7}}, "clients"),
    ({"data": {"batch_size": 10**7}}, "batch_size"),
    ({"data": {"train_tokens": 10**15}}, "train_tokens"),
    ({"federation": {"local_iterations": 10**12}}, "local_iterations"),
    ({"federation": {"rounds": 10**9}}, "rounds"),
    ({"experts": {"lora_rank": 10**6}}, "lora_rank"),
    ({"experts": {"top_k": 5}}, "top_k = 5 experts, but no device holds more than 2"),
])
def test_sizes_no_machine_could_hold_are_refused_before_anything_is_allocated(change, expected):
    raw = yaml.safe_load(TINY.read_text())
    raw.setdefault("experts", {})
    for key, value in change.items():
        raw[key] = {**raw[key], **value}
    with pytest.raises(UserError, match=expected):
        validate_recipe(raw)


def test_a_hundred_thousand_users_and_5000_clients_over_1797_digits_are_refused():
    raw = yaml.safe_load(TINY.read_text())
    raw["data"]["users"] = [{"name": f"u{i}", "source": "python-code"} for i in range(100_000)]
    with pytest.raises(UserError, match="users"):
        validate_recipe(raw)
    from ondevice_moe.data.small import build_small_task

    with pytest.raises(UserError, match="deals 1797 images to 5000 clients"):
        build_small_task("digits-dirichlet", 5000, 0)


def test_a_lora_rank_wider_than_its_layer_is_one_message():
    from ondevice_moe.experts.lora import LoRA

    with pytest.raises(UserError, match="LoRA rank 128 is wider than the 32 → 96 layer"):
        LoRA(32, 96, rank=128)
    assert LoRA(384, 2, rank=8).rank == 8  # a classifier head carries the body's rank


def test_a_recipe_that_is_a_fifo_a_deep_nest_or_megabytes_is_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "fifo.yaml")  # opening it to read would wait for a writer forever
    code, output = _dry_run(tmp_path / "fifo.yaml")
    assert code == 2 and "is not a regular file" in output
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    code, output = _dry_run(tmp_path / "deep.yaml")
    assert code == 2 and "nests lists or mappings hundreds of levels deep" in output and "Traceback" not in output
    (tmp_path / "big.yaml").write_text("name: x\n#" + "a" * 3_000_000 + "\n")
    code, output = _dry_run(tmp_path / "big.yaml")
    assert code == 2 and "a recipe is at most 1 MiB" in output
    result = runner.invoke(app, ["finetune", str(TINY), "--dry-run", "--set", "data.batch_size=" + "[" * 3000])
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_a_run_folders_log_that_is_a_fifo_or_nests_too_deep_is_one_message(tmp_path):
    from ondevice_moe.report import CorruptLog, MetricsLog

    os.mkfifo(tmp_path / "metrics.jsonl")
    with pytest.raises(CorruptLog, match="not a regular file"):
        MetricsLog(tmp_path / "metrics.jsonl").read()
    deep = tmp_path / "deep"
    deep.mkdir()
    (deep / "metrics.jsonl").write_text('{"kind": "eval", "method": "m", "x": ' + "[" * 100_000 + "]" * 100_000
                                        + "}\n")
    with pytest.raises(CorruptLog, match="line 1 is not a metrics record"):
        MetricsLog(deep / "metrics.jsonl").read()


def test_the_toolkit_never_writes_through_a_link_planted_in_a_folder_it_writes(tmp_path):
    from ondevice_moe.report import MetricsLog
    from ondevice_moe.safe_files import plain_folder, save_tensors, write_text

    target = tmp_path / "elsewhere"
    target.write_text("the user's own file")
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("report.md", "summary.json", "checkpoint.safetensors"):
        (folder / name).symlink_to(target)
    write_text(folder / "report.md", "# report")
    write_text(folder / "summary.json", "{}")
    import torch

    save_tensors(folder / "checkpoint.safetensors", {"w": torch.zeros(2)})
    assert target.read_text() == "the user's own file"
    assert not (folder / "report.md").is_symlink() and (folder / "report.md").read_text() == "# report"
    (folder / "metrics.jsonl").symlink_to(target)
    with pytest.raises(OSError):
        MetricsLog(folder / "metrics.jsonl").write({"kind": "x", "method": "m"})
    assert target.read_text() == "the user's own file"
    (folder / "plots").symlink_to(tmp_path)
    with pytest.raises(UserError, match="is a link, and the toolkit does not write through links"):
        plain_folder(folder / "plots")
    with pytest.raises(UserError, match="is a link"):
        write_text(folder / "plots" / "rounds.png", "png")


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
def test_a_model_folder_that_asks_to_run_its_own_code_is_refused(tmp_path, saved_tiny_models, file):
    import json
    import shutil

    from ondevice_moe.models.registry import load_base_model

    folder = tmp_path / "model"
    shutil.copytree(saved_tiny_models["tiny-llama"], folder)
    config = json.loads((folder / file).read_text()) if (folder / file).exists() else {}
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (folder / file).write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text(f"open({str(tmp_path / 'EXECUTED')!r}, 'w').close()\n")
    with pytest.raises(UserError, match=f"asks to run its own code .*{file} maps AutoModelForCausalLM"):
        load_base_model(str(folder))
    assert not (tmp_path / "EXECUTED").exists()


def test_control_sequences_in_names_and_paths_never_reach_the_terminal(tmp_path):
    forged = tmp_path / "run\x1b]0;owned\x07\x1b[2J\u202e"
    forged.mkdir()
    result = runner.invoke(app, ["eval", str(forged)])
    assert result.exit_code == 2 and "is not a run folder" in result.output
    assert "\x1b" not in result.output and "\u202e" not in result.output
    assert "\\x1b]0;owned" in result.output and "\\u202e" in result.output  # shown, as its escape


def test_user_text_in_markdown_and_html_is_escaped_and_cannot_close_its_block():
    from ondevice_moe.export.model_card import _fenced
    from ondevice_moe.inspect.page import html_page
    from ondevice_moe.names import markdown_cell

    cell = markdown_cell("<img src=x onerror=alert(1)> | forged |\n| row |\x1b[31m")
    assert "<" not in cell and "\n" not in cell and "\x1b" not in cell
    assert re.search(r"(?<!\\)\|", cell) is None  # every | escaped: no cell ends, no row begins
    block = _fenced("````\n# not a heading\n<script>", "yaml")
    assert block.startswith("`````yaml\n") and block.endswith("\n`````\n")  # longer than any run inside it
    page = html_page("t", ["<p>token \x1b[2J and \x08 and \u202e</p>"])
    assert not any(ch in page for ch in "\x1b\x08\u202e") and "\\x1b[2J" in page


def test_a_full_disk_is_one_message(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "ondevice_moe", "recipes", "copy", "demo", "/dev/full",  # Linux
                             "--force"], capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "no space is left" in output and "fix:" in output and "Traceback" not in output
