"""Bad input ends with one message naming the key or file and the fix — no traceback."""

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ondevice_moe.cli import app

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
runner = CliRunner()


def _run(*args: str):
    result = runner.invoke(app, ["finetune", *args])
    assert "Traceback" not in result.output
    return result


def _recipe(tmp_path: Path, edit) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    edit(raw)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda r: r["federation"].update(roundz=3), "federation.roundz: unknown key; valid keys here: rounds"),
        (lambda r: r["federation"].update(rounds="many"), "federation.rounds: Input should be a valid integer"),
        (lambda r: r["model"].update(name="gpt-17"), "unknown model 'gpt-17'"),
        (lambda r: r["data"]["users"][0].update(source="wikipedia-offline"), "unknown data source"),
        (lambda r: r["methods"].append("fedprox"), "unknown method 'fedprox'"),
    ],
)
def test_recipe_problems_name_the_key(tmp_path, edit, expected):
    result = _run(str(_recipe(tmp_path, edit)), "--output", str(tmp_path / "run"))
    assert result.exit_code == 2
    assert expected in " ".join(result.output.split())


def test_missing_recipe_file(tmp_path):
    result = _run(str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2 and "does not exist" in result.output


def test_malformed_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: [unclosed\n")
    result = _run(str(path))
    assert result.exit_code == 2 and "not valid YAML" in result.output


def test_bad_override_syntax():
    result = _run(str(TINY), "--set", "federation.rounds")
    assert result.exit_code == 2 and "key=value" in result.output


def test_user_with_too_little_text(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("only a handful of characters")
    path = _recipe(tmp_path, lambda r: r["data"]["users"].append({"name": "small", "source": "text-folder",
                                                                  "path": str(folder)}))
    result = _run(str(path), "--output", str(tmp_path / "run"))
    assert result.exit_code == 2
    assert "user 'small' has" in result.output and "fix:" in result.output


def test_missing_data_folder(tmp_path):
    path = _recipe(tmp_path, lambda r: r["data"]["users"].append({"name": "gone", "source": "text-folder",
                                                                  "path": str(tmp_path / "missing")}))
    result = _run(str(path), "--output", str(tmp_path / "run"))
    assert result.exit_code == 2 and "does not exist" in result.output


def test_recipes_list_shows_bundled_recipes():
    result = runner.invoke(app, ["recipes", "list"])
    assert result.exit_code == 0 and "demo.yaml" in result.output
