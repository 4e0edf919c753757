"""Every script in examples/ runs as its docstring says, on the tiny random GPT-2 (seconds, offline):
a bundled recipe from Python, a user's own files, and an export loaded by plain ``peft`` that writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _run(script: str, *args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_every_example_is_tested():
    tested = {"finetune_a_recipe.py", "your_own_data.py", "export_and_generate.py"}
    assert {path.name for path in EXAMPLES.glob("*.py")} == tested


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("examples")
    out = _run("finetune_a_recipe.py", "--model", "tiny-gpt2", "--output", "run", cwd=folder)
    summary = json.loads((folder / "run" / "summary.json").read_text())
    for method in ("fedavg", "comigs-1G1S"):  # the quickstart's methods, each user's figure printed
        line = next(line for line in out.splitlines() if line.startswith(method))
        printed = [float(value) for value in line.split()[1:]]
        per_user = summary["methods"][method]["per_user"]
        assert printed == pytest.approx([per_user["code"]["in"], per_user["news"]["in"],
                                         summary["methods"][method]["mean_in"]], abs=0.006)
    return folder / "run"


def test_finetune_a_recipe_runs_the_quickstart_and_prints_its_table(quickstart_run):
    recipe = (quickstart_run / "recipe.yaml").read_text()
    assert "name: quickstart" in recipe and "tiny-gpt2" in recipe


def test_your_own_data_trains_one_user_per_file(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    for index in range(6):
        (notes / f"{index}.txt").write_text(f"Note {index}: the garden needs water on Tuesdays. " * 60)
    (tmp_path / "mail.jsonl").write_text("".join(
        json.dumps({"body": f"Dear team, meeting {index} moves to room {index + 3}. " * 40}) + "\n"
        for index in range(12)))
    out = _run("your_own_data.py", "alice=notes", "bob=mail.jsonl#body",
               "--model", "tiny-gpt2", "--output", "own", cwd=tmp_path)
    summary = json.loads((tmp_path / "own" / "summary.json").read_text())
    assert summary["users"] == ["alice", "bob"] and "fedavg {'alice':" in out


def test_your_own_data_names_a_wrong_field_in_one_line(tmp_path):
    (tmp_path / "mail.jsonl").write_text(json.dumps({"body": "hello " * 500}) + "\n")
    done = subprocess.run([sys.executable, str(EXAMPLES / "your_own_data.py"), "bob=mail.jsonl",
                           "--model", "tiny-gpt2", "--output", "own"], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "text" in done.stderr and "body" in done.stderr  # the field asked for and the one the file has
    assert not (tmp_path / "own").exists(), "no run folder for inputs that do not check out"


def test_export_and_generate_loads_the_adapter_with_peft_and_writes(quickstart_run, tmp_path):
    out = _run("export_and_generate.py", str(quickstart_run), "--user", "news", "--prompt", "The bank",
               "--to", str(tmp_path / "news"), "--max-new-tokens", "8", cwd=tmp_path)
    config = json.loads((tmp_path / "news" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    lines = out.strip().splitlines()
    assert lines[-1] == "(8 new tokens)" and "The bank" in lines[-2]
