"""The docs' examples run: every ```yaml block in README.md and docs/*.md is a recipe or a recipe fragment.

A fragment (no ``name``, or no ``data``/``task``) is laid over a test recipe and must validate over at least one
of them. Offline data sources' ``categories`` are checked against the real labels, and every ``recipes/*.yaml``
path the docs name must be a bundled recipe. YAML that is not a recipe belongs in another fence (```text).
"""

import copy
import re
from pathlib import Path

import pytest
import yaml

from ondevice_moe import BUNDLED_RECIPES
from ondevice_moe.data.sources import OFFLINE_SOURCES, documents
from ondevice_moe.errors import UserError
from ondevice_moe.recipe import Recipe, validate_recipe

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BASES = [Path(__file__).parent / "recipes" / name for name in ("tiny.yaml", "tiny-classification.yaml")]
FENCE = re.compile(r"^```yaml\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{doc.relative_to(ROOT)}:{line}", match.group(1)))
    return found


BLOCKS = _blocks()


def _merge(base: dict, fragment: dict) -> dict:
    """``fragment`` laid over ``base``: mappings merge key by key, anything else replaces."""
    merged = copy.deepcopy(base)
    for key, value in fragment.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _as_recipe(fragment: dict, where: str) -> Recipe:
    if {"name", "methods"} <= fragment.keys() and ("data" in fragment or "task" in fragment):
        return validate_recipe(fragment, source=where)
    problems = []
    for path in BASES:
        base = yaml.safe_load(path.read_text(encoding="utf-8"))
        if "data" in fragment or "task" in fragment:  # the fragment says which kind of run it is
            base.pop("task" if "data" in fragment else "data", None)
        try:
            return validate_recipe(_merge(base, fragment), source=f"{where} over {path.name}")
        except UserError as error:
            problems.append(error.problem)
    raise AssertionError("\n".join(problems))


def test_the_docs_have_yaml_examples():
    assert any(where.startswith("docs/recipes.md") for where, _ in BLOCKS)


@pytest.mark.parametrize(("where", "text"), BLOCKS, ids=[where for where, _ in BLOCKS])
def test_yaml_block_is_a_valid_recipe(where, text):
    fragment = yaml.safe_load(text)
    assert isinstance(fragment, dict), f"{where} is not a mapping"
    recipe = _as_recipe(fragment, where)
    for user in recipe.data.users if recipe.data else []:
        for source in user.sources:
            if source.categories and source.source in OFFLINE_SOURCES:
                next(iter(documents(source.source, source.options())))  # unknown categories raise UserError


def test_documented_categories_are_real_labels():
    rows = re.findall(r"^\| `([\w-]+)` \| `categories` \(([^)]*)\)", (ROOT / "docs" / "recipes.md").read_text(),
                      re.MULTILINE)
    assert rows, "docs/recipes.md lists no source categories"
    for source, listed in rows:
        for category in (c.strip() for c in listed.split(",")):
            next(iter(documents(source, {"categories": [category]})))


def test_recipe_paths_in_the_docs_exist():
    named = {name for doc in DOCS for name in re.findall(r"(?<![\w/])recipes/([\w.-]+\.yaml)", doc.read_text())}
    assert named, "the docs name no recipes"
    missing = sorted(name for name in named if not (BUNDLED_RECIPES / name).is_file())
    assert not missing, f"the docs name recipes that are not bundled: {missing}"
