"""Inputs checked before anything is written: the run folder (a failed check leaves none, --overwrite),
--dry-run reading the data as a run does, and inspect's and export's destinations checked before torch loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ondevice_moe import runner
from ondevice_moe.cli import app
from ondevice_moe.report import MetricsLog

DOCS = Path(__file__).parents[1] / "docs"
TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
BUDGETS = {"train_tokens": 640, "valid_tokens": 320, "test_tokens": 320}  # 20 / 10 / 10 blocks of 32 bytes
cli = CliRunner()


@pytest.fixture(scope="module")
def user_files(tmp_path_factory) -> dict[str, Path]:
    """One JSON-lines file per user, a paragraph of one of the docs per line (field ``body``)."""
    folder = tmp_path_factory.mktemp("users")
    files = {}
    for user, doc in (("comigs", "comigs.md"), ("hermes", "hermes.md"), ("floral", "floral.md")):
        paragraphs = [p for p in (DOCS / doc).read_text(encoding="utf-8").split("\n\n") if p.strip()]
        files[user] = folder / f"{user}.jsonl"
        files[user].write_text("".join(json.dumps({"body": p}) + "\n" for p in paragraphs), encoding="utf-8")
    return files


def _recipe(folder: Path, files: dict[str, Path], text_field: str, seed: int = 0) -> Path:
    """The tiny recipe with its users reading ``files`` through ``text_field``."""
    raw = yaml.safe_load(TINY.read_text(encoding="utf-8"))
    raw["seed"] = seed
    raw["methods"] = ["pretrained", "fedavg"]
    raw["data"] |= BUDGETS
    raw["data"]["users"] = [{"name": user, "source": "jsonl", "path": str(path), "text_field": text_field}
                            for user, path in files.items()]
    path = folder / f"recipe-{text_field}-{seed}.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def _names_the_missing_field(output: str) -> bool:
    """The loader's error for a wrong ``text_field``: the field it looked for, and the fix."""
    return "'text'" in output and "fix: set `text_field`" in output and "Traceback" not in output


@pytest.fixture
def simulated(monkeypatch) -> list[str]:
    """Flower replaced by a stand-in that logs each method as finished with made-up perplexities: these
    tests are about the run folder, which the real inputs check and the real report still write."""
    methods: list[str] = []

    def simulate(jobs, *_):
        log = MetricsLog(jobs[0].run_dir / "metrics.jsonl")
        for job in jobs:
            methods.append(job.method.name)
            for user in job.recipe.user_names:
                log.write({"method": job.method.name, "round": 0, "kind": "eval", "user": user,
                           "test_ppl_in": 9.0, "test_ppl_out": 9.0})
            log.write({"method": job.method.name, "kind": "done", "rounds": 0})

    monkeypatch.setattr(runner, "_simulate", simulate)
    return methods


def test_a_failed_input_check_leaves_no_folder_and_the_corrected_command_runs(tmp_path, user_files, simulated):
    out = tmp_path / "run"
    wrong = cli.invoke(app, ["finetune", str(_recipe(tmp_path, user_files, "text")), "--output", str(out)])
    assert wrong.exit_code == 2 and _names_the_missing_field(wrong.output)
    assert not out.exists() and simulated == []
    corrected = _recipe(tmp_path, user_files, "body")
    right = cli.invoke(app, ["finetune", str(corrected), "--output", str(out)])
    assert right.exit_code == 0, right.output
    assert simulated == ["pretrained", "fedavg"]
    assert yaml.safe_load((out / "recipe.yaml").read_text())["data"]["users"][0]["sources"][0]["text_field"] == "body"
    assert set(json.loads((out / "summary.json").read_text())["methods"]) == {"pretrained", "fedavg"}


def test_overwrite_replaces_a_run_of_another_recipe_only_once_the_inputs_check_out(tmp_path, user_files, simulated):
    out = tmp_path / "run"
    first = _recipe(tmp_path, user_files, "body", seed=0)
    assert cli.invoke(app, ["finetune", str(first), "--output", str(out)]).exit_code == 0
    (out / "checkpoints" / "fedavg").mkdir(parents=True)
    (out / "checkpoints" / "fedavg" / "device_0.safetensors").write_bytes(b"old")
    (out / "notes.txt").write_text("mine")  # not the run's: --overwrite leaves it
    before = (out / "metrics.jsonl").read_text()

    other = _recipe(tmp_path, user_files, "body", seed=1)
    refused = cli.invoke(app, ["finetune", str(other), "--output", str(out)])
    assert refused.exit_code == 2 and "different recipe" in refused.output and "--overwrite" in refused.output
    broken = _recipe(tmp_path, user_files, "text", seed=1)
    failed = cli.invoke(app, ["finetune", str(broken), "--output", str(out), "--overwrite"])
    assert failed.exit_code == 2 and _names_the_missing_field(failed.output)
    assert (out / "metrics.jsonl").read_text() == before and (out / "checkpoints").is_dir()  # nothing lost

    replaced = cli.invoke(app, ["finetune", str(other), "--output", str(out), "--overwrite"])
    assert replaced.exit_code == 0, replaced.output
    assert yaml.safe_load((out / "recipe.yaml").read_text())["seed"] == 1
    assert not (out / "checkpoints").exists() and (out / "notes.txt").read_text() == "mine"
    assert [r["kind"] for r in MetricsLog(out / "metrics.jsonl").read()].count("done") == 2  # the new run's only
    assert simulated == ["pretrained", "fedavg"] * 2


def test_dry_run_reads_the_data_as_a_run_does(tmp_path, user_files):
    out = tmp_path / "run"
    wrong = cli.invoke(app, ["finetune", str(_recipe(tmp_path, user_files, "text")), "--dry-run",
                             "--output", str(out)])
    assert wrong.exit_code == 2 and _names_the_missing_field(wrong.output)
    right = cli.invoke(app, ["finetune", str(_recipe(tmp_path, user_files, "body")), "--dry-run",
                             "--output", str(out)])
    assert right.exit_code == 0, right.output
    rows = [line.split("│") for line in right.output.splitlines() if line.startswith("│ ") and "/" in line]
    data = {cells[1].strip(): [cell.strip() for cell in cells[2:6]] for cells in rows if cells[1].strip() in user_files}
    assert data == {user: ["640", "320", "320", "20 / 10 / 10"] for user in user_files}  # tokens, blocks per split
    assert not out.exists()


def test_dry_run_of_a_classification_recipe_counts_each_clients_labels():
    result = cli.invoke(app, ["finetune", str(TINY.with_name("tiny-classification.yaml")), "--dry-run"])
    assert result.exit_code == 0, result.output
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in result.output.splitlines()
            if line.startswith("│ client_")]
    assert [row[0] for row in rows] == ["client_0", "client_1", "client_2"]
    for _, train, _, labels in rows:
        counts = {name: int(count) for name, count in (part.rsplit(" ", 1) for part in labels.split(", "))}
        assert set(counts) <= {"rotten", "fresh"} and sum(counts.values()) == int(train)


@pytest.mark.parametrize(("command", "problem"), [
    (["inspect", "--to", "{tmp}/missing/page.html"], "folder {tmp}/missing does not exist"),
    (["inspect", "--to", "{tmp}"], "--to {tmp} is a folder"),
    (["export", "--to", "{tmp}/file/out"], "--to {tmp}/file/out lies under {tmp}/file, a file"),
    (["export", "--to", "{tmp}/file"], "--to {tmp}/file is a file"),
])
def test_a_bad_destination_fails_before_torch_loads(tmp_path, command, problem):
    (tmp_path / "file").write_text("x")
    verb, *options = (argument.format(tmp=tmp_path) for argument in command)
    arguments = [verb, "no-run", "--method", "m", "--user", "u", *options]
    script = ("import sys; from typer.testing import CliRunner; from ondevice_moe.cli import app; "
              f"result = CliRunner().invoke(app, {arguments!r}); "
              "print(result.exit_code, 'torch' in sys.modules); print(result.output)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.startswith("2 False"), done.stdout + done.stderr
    assert problem.format(tmp=tmp_path) in " ".join(done.stdout.split())


def test_export_makes_missing_folders_under_a_writable_one(tmp_path):
    from ondevice_moe.destination import check_folder_destination

    check_folder_destination(tmp_path / "new" / "deeper", "--to")  # mkdir(parents=True) will make both
    assert not (tmp_path / "new").exists()  # the check writes nothing
