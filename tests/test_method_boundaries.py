"""A method's work lives in its folder: the shared trainer, the device runtime, the ClientApp, the
evaluation and the strategy know only the hooks of :class:`~ondevice_moe.methods.procedure.Procedure`,
of :class:`~ondevice_moe.server_rules.rules.ServerRule` and of the routers' lifecycle
(:mod:`ondevice_moe.routing.lifecycle`)."""

import ast
import re
from pathlib import Path

import pytest

from ondevice_moe.methods import METHODS, method_for
from ondevice_moe.methods.procedure import Procedure

PACKAGE = Path(__file__).resolve().parents[1] / "ondevice_moe"
DEVICE = tuple(f"federation/device/{part}.py"
               for part in ("__init__", "base", "data", "model", "upload", "checkpoints", "rounds"))
CORE = ("training.py", *DEVICE, "federation/client_app.py", "federation/evaluation.py",
        "federation/strategy.py", "server_rules/aggregation.py", "server_rules/rules.py", "routing/lifecycle.py",
        "methods/base.py", "methods/procedure.py")
# What moved into the method folders (issue 34): none of it may appear in the core again.
MOVED = ("peer_mixing", "experts_in_turn", "pruning_lambda", "pruning_strength", "lora_preconditioning",
         "precondition", "CentreProcedure", "FlowProcedure", "anchor_to_centres", "received_centres",
         "local_model_of", "IMPORTANCE_KEY", "trains_every_centre", "ProximalAnchors", "policy_regulariser",
         "flow_round", "adapted_for_test", "mix_peers", "fit_fusion", "rank_pruning", "zero_pruned_ranks",
         "pruning_penalty", "procedure.flow", "procedure.centres", ".anchors", ".uploads")
INTERFACE = {"ondevice_moe.methods", "ondevice_moe.methods.base", "ondevice_moe.methods.procedure"}


def _code_without_docstrings(path: Path) -> str:
    """The module's code with its docstrings blanked (they may cite the methods they serve)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = path.read_text(encoding="utf-8").splitlines()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            for line in range(body[0].lineno - 1, body[0].end_lineno):
                lines[line] = ""
    return "\n".join(line.split("#")[0] for line in lines)


@pytest.mark.parametrize("module", CORE)
def test_the_core_names_no_concept_that_moved_into_a_method_folder(module):
    code = _code_without_docstrings(PACKAGE / module)
    found = [name for name in MOVED if re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", code)]
    assert not found, f"{module} still names {found}: move that code into the method's folder"


@pytest.mark.parametrize("module", CORE)
def test_the_core_imports_no_method_folder(module):
    tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    folders = {name for name in imported if name.startswith("ondevice_moe.methods") and name not in INTERFACE}
    assert not folders, f"{module} imports {sorted(folders)}: reach a method through its procedure's hooks"


OWN_PROCEDURES = {"pcl": {}, "fdlora": {}, "hetlora": {"ranks": [4, 4, 4]}, "floral": {"clusters": 2},
                  "local-adaptor": {}, "fedavg-adaptor": {}, "fedsoft": {"clusters": 2}, "ifca": {"clusters": 2},
                  "fedem": {"clusters": 2}, "flow": {}, "fedavgft": {}, "ditto": {}, "apfl": {}}


@pytest.mark.parametrize("name", sorted(OWN_PROCEDURES))
def test_a_method_with_device_work_of_its_own_runs_a_procedure_of_its_folder(name):
    """PCL, FDLoRA, HetLoRA, FLoRAL's adaptors, FedSoft's family and Flow's each run a procedure
    class of their own folder; the rest run the plain one."""
    procedure = type(method_for(name, 3, **OWN_PROCEDURES[name]).procedure)
    assert procedure is not Procedure, f"{name} runs the plain procedure"
    folder = METHODS[name].build.__module__.rsplit(".", 1)[0]
    assert procedure.__module__.startswith(folder + "."), f"{name}'s procedure lives outside its folder {folder}"


def test_a_method_without_device_work_of_its_own_runs_the_plain_procedure():
    assert type(method_for("fedavg", 3).procedure) is Procedure


METHOD_WORDS = ("hermes", "floral", "comigs", "fedsoft", "flow", "ifca", "fedem", "pcl", "fdlora", "hetlora",
                "fedprox", "ditto", "apfl", "fedunipelt", "centre", "centres")
# Outside the method folders, only these modules still name a method, each for what is left to move out
# (issue 63); the list may only shrink. The registry lists the methods and the scaffold writes one.
STILL_NAMING = {
    "methods/registry.py": "the registry: it names every method by design",
    "methods/scaffold.py": "the scaffold's template and its help text",
    "cli.py": "export/eval --centre (FedSoft, IFCA) and method names in help texts",
    "recipe.py": "error messages naming FLoRAL's options and the rules that weigh by centres",
    # layout.py split into one module per mixing (issue 63): the same names, now where each is used.
    "layout/spec.py": "router kinds named after their papers ('hermes'), Flow's layout rule in its error",
    "layout/routers.py": "the Hermes router's factory, a router kind named after its paper",
    "layout/attach.py": "the Hermes router among the modules put on the base's device",
    "layout/block_mixture.py": "the Hermes router's expert parameters (its gradient view)",
    "layout/mlp_mixture.py": "the Hermes router's expert parameters; the CoMiGS mixture named in an error",
    "layout/layer_copies.py": "Flow's layer copies named in an error",
    "federation/device/checkpoints.py": "FedSoft's server checkpoints of the centres",
    "server_rules/peers.py": "PCL's per-device slots",
    "export/bundle.py": "--centre",
    "inspect/__init__.py": "per-method notes of the routing page",
    "inspect/capture.py": "the Hermes router's capture",
    "inspect/plots.py": "Flow's instance-routing plot",
    "inspect/rounds.py": "Flow's instance-routing rounds",
    "routing/hermes.py": "the Hermes router, a building block named after its paper",
    "routing/fusion.py": "FDLoRA's fusion, a building block named after its paper",
    "data/small.py": "the synthetic tasks of the FedSoft and FLoRAL papers",
    "data/tasks.py": "the tasks of the FedSoft and FLoRAL papers",
    "models/registry.py": "FLoRAL's small models",
}


def _naming_modules() -> dict[str, list[str]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module.startswith("methods/") and module.count("/") >= 2:
            continue  # a method's own folder
        code = _code_without_docstrings(path).lower()
        words = [w for w in METHOD_WORDS if re.search(rf"(?<![a-z0-9_]){re.escape(w)}(?![a-z0-9])", code)]
        if words:
            found[module] = words
    return found


def test_outside_the_method_folders_only_a_shrinking_list_of_modules_names_a_method():
    """The trainer, the strategy, the aggregation, the server-rule base, the client and the step hooks
    name no method; a module not on the list that starts naming one fails, and so does a listed
    module that no longer does (take it off the list)."""
    found = _naming_modules()
    assert not set(found) - set(STILL_NAMING), {m: w for m, w in found.items() if m not in STILL_NAMING}
    assert not set(STILL_NAMING) - set(found), f"no longer name a method: {sorted(set(STILL_NAMING) - set(found))}"
    for module in ("training.py", "federation/strategy.py", "server_rules/aggregation.py", "server_rules/rules.py",
                   "federation/client_app.py", "methods/procedure.py", "routing/lifecycle.py"):
        assert module not in found
