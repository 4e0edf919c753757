"""A method's device work lives in its folder: the shared trainer, the device runtime, the
ClientApp and the evaluation know only the hooks of :class:`~ondevice_moe.methods.procedure.Procedure`."""

import ast
import re
from pathlib import Path

import pytest

from ondevice_moe.methods import METHODS, method_for
from ondevice_moe.methods.procedure import Procedure

PACKAGE = Path(__file__).resolve().parents[1] / "ondevice_moe"
CORE = ("training.py", "federation/device.py", "federation/client_app.py", "federation/evaluation.py",
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
