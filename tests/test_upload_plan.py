"""What ``finetune --dry-run`` says a device uploads is what it sends, for every built-in method:
one round of each, served in-process (:class:`test_strategy.InProcessGrid`), its ``train`` records'
tensor bytes against the plan (:func:`~ondevice_moe.plan.device_plan`). Methods whose routers choose
the experts that travel (Hermes) send at most the plan."""

from pathlib import Path

import pytest
import yaml
from test_strategy import InProcessGrid

from ondevice_moe.federation import server_app
from ondevice_moe.federation.job import JOB_ENV, Job
from ondevice_moe.methods import registry
from ondevice_moe.methods.spec import CLASSIFICATION, LANGUAGE, SMALL
from ondevice_moe.plan import device_plan
from ondevice_moe.recipe import validate_recipe
from ondevice_moe.report import MetricsLog
from ondevice_moe.run_folder import RunFolder

RECIPES = Path(__file__).parent / "recipes"
SMALLEST_TASK = {SMALL: "tiny-digits.yaml", LANGUAGE: "tiny.yaml", CLASSIFICATION: "tiny-classification.yaml"}
REQUIRED = {"flexlora": {"ranks": [4, 4, 2]}, "hetlora": {"ranks": [4, 4, 2]},  # options without a default
            "mixture": {"experts": [{"kind": "layers", "role": "shared"}, {"kind": "layers", "role": "private"}],
                        "router": "client-mixture", "mixing": "every-layer", "routers_train": "joint",
                        "aggregation": "mixture-weighted"}}


def _recipe(method: str):
    tasks = registry.BUILT_IN[method].tasks
    file = next(SMALLEST_TASK[task] for task in (SMALL, LANGUAGE, CLASSIFICATION) if task in tasks)
    raw = yaml.safe_load((RECIPES / file).read_text())
    raw["methods"] = [{"name": method, **REQUIRED.get(method, {})}]
    raw["federation"].update(rounds=1, local_iterations=1, local_epochs=None)
    return validate_recipe(raw)


@pytest.mark.parametrize("method", sorted(registry.BUILT_IN))
def test_each_built_in_methods_upload_is_what_its_dry_run_says(method, tmp_path, monkeypatch):
    recipe = _recipe(method)
    job = Job(recipe, 0, RunFolder(recipe, tmp_path).prepare())
    planned = [device_plan(job, device).uploaded_bytes for device in range(len(job.method.layouts))]
    monkeypatch.setenv(JOB_ENV, str(job.to_file(tmp_path / ".job.json").resolve()))
    server_app.run_federation(InProcessGrid(len(job.method.layouts)), job, MetricsLog(tmp_path / "metrics.jsonl"))
    records = MetricsLog(tmp_path / "metrics.jsonl").read()
    sent = {r["user"]: r["bytes_up"] - r.get("bytes_up_records", 0) for r in records if r["kind"] == "train"}
    assert len(sent) == (len(planned) if job.method.trains else 0), records[-3:]
    for user, tensor_bytes in sent.items():
        plan = planned[0 if job.method.centralized else recipe.user_names.index(user)]
        if job.method.sharing.selected_only:
            assert 0 < tensor_bytes <= plan, user
        else:
            assert tensor_bytes == plan, (user, tensor_bytes, plan)
