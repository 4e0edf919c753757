"""Methods from outside the package: a recipe's plug-in files, an installed package's entry point,
and the folder `ondevice-moe new-method` scaffolds."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ondevice_moe.errors import UserError
from ondevice_moe.methods import registry
from ondevice_moe.methods.plugins import TRUST_ENV
from ondevice_moe.methods.scaffold import scaffold
from ondevice_moe.recipe import load_recipe

TINY_DIGITS = Path(__file__).parent / "recipes" / "tiny-digits.yaml"


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """Each test registers into a copy of the registry, so no plug-in outlives it."""
    kept = (dict(registry.REGISTRY.specs), dict(registry.REGISTRY.origins), set(registry.REGISTRY._files))
    monkeypatch.delenv(TRUST_ENV, raising=False)
    yield
    for store, saved in zip((registry.REGISTRY.specs, registry.REGISTRY.origins, registry.REGISTRY._files), kept,
                            strict=True):
        store.clear()
        store.update(saved)


def _recipe_with_plugin(folder: Path, plugin: str, methods: list) -> Path:
    raw = yaml.safe_load(TINY_DIGITS.read_text())
    raw.update(plugins=[plugin], methods=methods)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_recipes_plugin_runs_no_code_until_the_user_trusts_it(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\nMETHODS = {{}}\n")
    recipe = _recipe_with_plugin(tmp_path, "evil.py", ["fed-ft"])
    with pytest.raises(UserError, match="code would run") as caught:
        load_recipe(recipe)
    assert "--trust-plugins" in caught.value.fix and not marker.exists()


def test_a_trusted_plugin_folder_registers_its_method_with_its_origin(tmp_path, monkeypatch):
    scaffold("fedprox", tmp_path)
    monkeypatch.setenv(TRUST_ENV, "1")
    recipe = load_recipe(_recipe_with_plugin(tmp_path, "fedprox", [{"name": "fedprox", "mu": 0.5}, "fed-ft"]))
    method = recipe.method(0)
    assert method.name == "fedprox" and method.procedure.mu == 0.5
    assert registry.method_origins()["fedprox"] == f"file {tmp_path / 'fedprox'}"
    assert recipe.plugins == [str(tmp_path / "fedprox")], "kept absolute, so the run folder's copy finds it"
    assert "fedprox" not in registry.BUILT_IN


@pytest.mark.parametrize(("source", "problem"), [
    ("def broken(:\n", "fails to import"),
    ("X = 1\n", "defines no METHODS"),
    ("METHODS = {'fedprox': 42}\n", "not a MethodSpec"),
    ("from ondevice_moe.methods.registry import BUILT_IN\nMETHODS = {'fedavg': BUILT_IN['fed-ft']}\n", "clashes"),
])
def test_a_bad_plugin_file_is_one_clear_message(tmp_path, monkeypatch, source, problem):
    (tmp_path / "plugin.py").write_text(source)
    monkeypatch.setenv(TRUST_ENV, "1")
    with pytest.raises(UserError, match=problem):
        load_recipe(_recipe_with_plugin(tmp_path, "plugin.py", ["fed-ft"]))
    assert registry.BUILT_IN["fedavg"] is registry.METHODS["fedavg"]


def test_the_scaffold_refuses_a_taken_folder_and_a_bad_name(tmp_path):
    scaffold("fedprox", tmp_path)
    with pytest.raises(UserError, match="already exists"):
        scaffold("fedprox", tmp_path)
    with pytest.raises(UserError, match="cannot name a folder"):
        scaffold("../up", tmp_path)


def test_a_hyphenated_name_scaffolds_a_package_of_valid_python(tmp_path):
    folder = scaffold("my-method", tmp_path)
    assert folder.name == "my_method"
    for file in folder.glob("*.py"):
        compile(file.read_text(), str(file), "exec")  # a SyntaxError fails the test
    assert "METHODS = {\"my-method\": SPEC}" in (folder / "__init__.py").read_text()


def test_methods_list_shows_a_trusted_recipes_plugin_files(tmp_path):
    from typer.testing import CliRunner

    from ondevice_moe.cli import app

    scaffold("fedprox", tmp_path)
    recipe = _recipe_with_plugin(tmp_path, "fedprox", ["fedprox", "fed-ft"])
    refused = CliRunner().invoke(app, ["methods", "list", "--recipe", str(recipe)], env={"COLUMNS": "300"})
    assert refused.exit_code == 2 and "--trust-plugins" in refused.output
    listed = CliRunner().invoke(app, ["methods", "list", "--recipe", str(recipe), "--trust-plugins"],
                                env={"COLUMNS": "300"})
    assert listed.exit_code == 0 and f"file {tmp_path / 'fedprox'}" in listed.output


def test_the_scaffolded_procedure_passes_its_own_test(tmp_path, monkeypatch):
    folder = scaffold("fedprox", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    generated = importlib.import_module(f"fedprox.{next(folder.glob('test_*.py')).stem}")
    generated.test_the_proximal_term_is_zero_at_the_received_weights_and_grows_away_from_them()
    for name in [name for name in sys.modules if name == "fedprox" or name.startswith("fedprox.")]:
        del sys.modules[name]


@pytest.mark.parametrize(("template", "task", "generated_test"), [
    ("custom-rule", "small", "test_the_server_keeps_a_velocity_and_moves_by_it"),
    ("private-head", "small", "test_the_dry_run_uploads_everything_but_the_head"),
    ("custom-rule", "language", "test_the_server_keeps_a_velocity_and_moves_by_it"),
    ("proximal", "language", "test_the_proximal_term_is_zero_at_the_received_weights_and_grows_away_from_them"),
])
def test_each_template_scaffolds_a_method_that_passes_its_own_quick_test(tmp_path, monkeypatch, template, task,
                                                                        generated_test):
    """The templates' Flower runs (their other generated test: at mu 0 / beta 0 / with shared heads the method
    equals the toolkit's FedAvg to the digit) were run by hand; here the generated code compiles, registers and
    passes its quick test."""
    folder = scaffold("my-method", tmp_path, template, task)
    for file in folder.glob("*.py"):
        compile(file.read_text(), str(file), "exec")
    monkeypatch.syspath_prepend(str(tmp_path))
    generated = importlib.import_module(f"my_method.{next(folder.glob('test_*.py')).stem}")
    try:
        getattr(generated, generated_test)(*((monkeypatch, tmp_path / "p") if "dry_run" in generated_test else ()))
    finally:
        for name in [name for name in sys.modules if name == "my_method" or name.startswith("my_method.")]:
            del sys.modules[name]


def test_an_unknown_template_names_the_choices(tmp_path):
    with pytest.raises(UserError, match="unknown template") as caught:
        scaffold("x", tmp_path, "fancy")
    assert "proximal, private-head, custom-rule" in caught.value.fix
    with pytest.raises(UserError, match="is for the small model") as caught:
        scaffold("x", tmp_path, "private-head", "language")
    assert "proximal, custom-rule" in caught.value.fix and not (tmp_path / "x").exists()


def test_a_language_template_holds_the_toolkits_fedavg_layout(tmp_path, monkeypatch):
    """At mu 0 the language template is the toolkit's fedavg: the same layout (its Flower run, checked by
    its generated test by hand, gives fedavg's perplexities to the digit)."""
    from ondevice_moe.methods.base import MethodContext

    scaffold("my-method", tmp_path, "proximal", "language")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        generated = importlib.import_module("my_method.method")
        options = importlib.import_module("my_method.options").Options(mu=0.0)
        ours = generated.build(options, MethodContext(num_users=2, weighting="uniform"))
        assert ours.layouts == registry.method_for("fedavg", 2).layouts
    finally:
        for name in [name for name in sys.modules if name == "my_method" or name.startswith("my_method.")]:
            del sys.modules[name]


def _install(site: Path) -> None:
    """An outside method as `pip install` leaves it: a package on the path with its entry point's metadata."""
    scaffold("fedprox", site)
    dist = site / "fedprox_method-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fedprox-method\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[ondevice_moe.methods]\nfedprox = fedprox:SPEC\n")


@pytest.mark.slow
def test_an_installed_packages_method_runs_through_flower_without_touching_the_package(tmp_path):
    site = tmp_path / "site"
    _install(site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    listed = subprocess.run([sys.executable, "-m", "ondevice_moe", "methods", "list"], env=env, check=True,
                            capture_output=True, text=True, timeout=120).stdout
    assert "fedprox" in listed and "package fedprox-method" in listed
    raw = yaml.safe_load(TINY_DIGITS.read_text())
    raw.update(methods=[{"name": "fedprox", "mu": 0.0}, {"name": "fedavg-adaptor", "preconditioning": False}])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    subprocess.run([sys.executable, "-m", "ondevice_moe", "finetune", str(recipe), "--output", str(tmp_path / "run")],
                   env=env, check=True, timeout=900)
    methods = json.loads((tmp_path / "run" / "summary.json").read_text())["methods"]
    assert methods["fedprox"]["mean_score"] == methods["fedavg-adaptor"]["mean_score"], "at mu = 0 FedProx is FedAvg"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("method") == "fedprox" and r.get("kind") == "done" for r in records)


FEDPER = Path(__file__).resolve().parents[1] / "examples" / "fedper"


def test_fedper_is_a_plugin_of_under_30_lines_of_method_code():
    import ast

    source = (FEDPER / "fedper.py").read_text()
    docstrings = {line for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Expr)
                  and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                  for line in range(node.lineno, node.end_lineno + 1)}
    code = [line for number, line in enumerate(source.splitlines(), 1)
            if number not in docstrings and line.strip() and not line.lstrip().startswith("#")]
    assert len(code) == 8  # imports 3, options 1, builder 3, registration 1


def test_fedper_keeps_each_head_home_and_sends_what_its_dry_run_says(tmp_path, monkeypatch):
    """FedPer from its plug-in file, through Flower beside FedAvg of the whole model: each device's
    upload is the body alone, to the byte the dry run promised; the heads stay on the devices."""
    from safetensors.torch import load_file

    from ondevice_moe.plan import plan_recipe
    from ondevice_moe.report import MetricsLog
    from ondevice_moe.runner import run_recipe

    monkeypatch.setenv(TRUST_ENV, "1")
    recipe = load_recipe(FEDPER / "recipe.yaml", ["federation.rounds=2"])
    planned = {plan.name: plan.devices for plan in plan_recipe(recipe, tmp_path / "plan")}
    assert planned["fedper"][0].uploaded == 4160 and planned["fed-ft"][0].uploaded == 4810  # the 64 → 10 head: 650
    result = run_recipe(recipe, tmp_path / "run")
    sent = [r for r in MetricsLog(result.run_dir / "metrics.jsonl").read() if r["kind"] == "train"]
    for record in sent:
        device = recipe.user_names.index(record["user"])
        assert record["bytes_up"] == planned[record["method"]][device].uploaded_bytes
    heads = [load_file(result.run_dir / "checkpoints" / "fedper" / f"device_{d}.safetensors")["net.3.weight"]
             for d in range(4)]
    assert not any(torch.equal(heads[0], head) for head in heads[1:]), "every device keeps a head of its own"
    assert result.summary["methods"]["fedper"]["mean_score"] > 0


FAMILY_PLUGIN = '''
from pydantic import BaseModel, ConfigDict

from ondevice_moe.server_rules.rules import ServerRule
from ondevice_moe.methods.base import Method, MethodContext, MethodOptions, Procedure, same_for_all
from ondevice_moe.methods.spec import SMALL, MethodSpec


class DampSizes(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    damping: float = 0.1


class DampOptions(DampSizes, MethodOptions):
    pass


def damped(options: DampOptions, context: MethodContext) -> Method:
    return Method(f"damped-{options.damping:g}", same_for_all(context.num_users, None),
                  procedure=Procedure(full_finetune=True), server_rule=ServerRule(context.weighting))


METHODS = {"damped": MethodSpec(DampOptions, damped, frozenset({SMALL}), "damp", section=DampSizes)}
'''


def test_a_plugin_family_brings_its_own_recipe_section(tmp_path, monkeypatch):
    """A plug-in family's section sits at the recipe's top level like a built-in one: it gives the
    family's defaults, is checked by the family's schema, and is written back where it was."""
    from ondevice_moe.run_folder import _resolved

    (tmp_path / "damp.py").write_text(FAMILY_PLUGIN)
    monkeypatch.setenv(TRUST_ENV, "1")
    path = _recipe_with_plugin(tmp_path, "damp.py", ["damped", {"name": "damped", "damping": 0.5}])
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**raw, "damp": {"damping": 0.7}}))
    recipe = load_recipe(path)
    assert [recipe.method(i).name for i in range(2)] == ["damped-0.7", "damped-0.5"]
    written = yaml.safe_load(_resolved(recipe))
    assert written["damp"] == {"damping": 0.7} and "plugin_sections" not in written
    assert load_recipe(path).model_dump() == recipe.model_dump()
    path.write_text(yaml.safe_dump({**raw, "damp": {"damping": "lots"}}))
    with pytest.raises(UserError, match="damping"):
        load_recipe(path)
    path.write_text(yaml.safe_dump({**raw, "dampp": {"damping": 0.7}}))
    with pytest.raises(UserError, match="dampp"):
        load_recipe(path)
