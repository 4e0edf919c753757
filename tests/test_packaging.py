"""The wheel ships the recipes, so `pip install ondevice-moe` users see them in `recipes list`."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomli

import ondevice_moe
from ondevice_moe import BUNDLED_RECIPES, distribution

ROOT = Path(__file__).resolve().parent.parent


def test_the_package_names_the_distributions_version_and_recipes():
    # every layer reads them from ondevice_moe.distribution; users from the package root
    project = tomli.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert ondevice_moe.__version__ == distribution.VERSION == project["version"]
    assert BUNDLED_RECIPES == distribution.BUNDLED_RECIPES


def test_top_level_recipes_path_is_the_package_folder():
    # README, Makefile, pyproject's flwr run config and the tests name recipes/<file>.yaml
    assert (ROOT / "recipes").resolve() == BUNDLED_RECIPES
    assert (ROOT / "recipes" / "demo.yaml").is_file()


def test_wheel_contains_the_recipes_and_the_command(tmp_path):
    source = tmp_path / "src"  # a copy, so setuptools' build/ and egg-info stay out of the working tree
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "ondevice_moe", source / "ondevice_moe",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp_path / "dist")], check=True, capture_output=True)
    wheel, = (tmp_path / "dist").glob("ondevice_moe-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    recipes = {Path(n).name for n in names if n.startswith("ondevice_moe/recipes/") and n.endswith(".yaml")}
    assert recipes == {path.name for path in BUNDLED_RECIPES.glob("*.yaml")}
    assert "demo.yaml" in recipes
    assert "ondevice_moe/py.typed" in names  # the type hints reach users (PEP 561)
    assert "ondevice-moe = ondevice_moe.cli:main" in entry_points
