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


def test_unterminated_override_value_names_the_override():
    result = _run(str(TINY), "--set", "methods=[fedavg")
    assert result.exit_code == 2
    output = " ".join(result.output.split())
    assert "override 'methods'" in output and "not valid YAML" in output and "fix:" in output


def test_override_below_a_value_is_refused():
    result = _run(str(TINY), "--set", "name.first=x")
    assert result.exit_code == 2 and "'name' is not a section" in result.output


def test_recipe_path_that_is_a_folder(tmp_path):
    result = _run(str(tmp_path))
    assert result.exit_code == 2 and "is a folder, not a YAML file" in " ".join(result.output.split())


def test_unreadable_recipe(tmp_path, monkeypatch):
    path = tmp_path / "locked.yaml"
    path.write_text(TINY.read_text())
    real_open = Path.open

    def refuse(self, *args, **kwargs):  # chmod 000 does not stop root, so the OS's refusal is simulated
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    result = _run(str(path))
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and "cannot read recipe" in output and "Permission denied" in output


def test_dirichlet_client_without_test_examples_fails_before_training(tmp_path):
    recipe = Path(__file__).parent / "recipes" / "tiny-classification.yaml"
    result = _run(str(recipe), "--set", "task.clients=8", "--set", "task.dirichlet_alpha=0.1",
                  "--set", "task.max_test_examples=10", "--output", str(tmp_path / "run"))
    assert result.exit_code == 2
    output = " ".join(result.output.split())
    assert "would get no test examples" in output and "task.max_test_examples" in output
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""  # no round ran
