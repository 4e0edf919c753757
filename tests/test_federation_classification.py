"""A real Flower simulation of Hermes and FedLoRA: tiny BERT, three Dirichlet clients."""

import json
from pathlib import Path

import pytest

from ondevice_moe import runner
from ondevice_moe.recipe import load_recipe

RECIPE = Path(__file__).parent / "recipes" / "tiny-classification.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    recipe = load_recipe(RECIPE)
    return recipe, runner.run_recipe(recipe, tmp_path_factory.mktemp("cls") / "run")


def test_every_client_reports_a_score(run):
    recipe, result = run
    for name in ("hermes", "fed-lora"):
        per_user = result.summary["methods"][name]["per_user"]
        assert set(per_user) == set(recipe.user_names)
        assert all(0.0 <= v["score"] <= 100.0 for v in per_user.values())


def test_hermes_uploads_usage_counts_and_all_three_expert_kinds(run):
    _, result = run
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    comm = {r["method"]: r for r in records if r["kind"] == "comm" and r["round"] == 1}
    assert comm["hermes"]["bytes_up"] > comm["fed-lora"]["bytes_up"] > 0
    assert (result.run_dir / "checkpoints" / "hermes" / "device_0.safetensors").exists()


def test_eval_command_recomputes_the_final_scores(run):
    from typer.testing import CliRunner

    from ondevice_moe.cli import app

    _, result = run
    outcome = CliRunner().invoke(app, ["eval", str(result.run_dir), "--suite", "glue"])
    assert outcome.exit_code == 0, outcome.output
    mean = result.summary["methods"]["hermes"]["mean_score"]
    assert f"{mean:.2f}" in outcome.output


def test_task_head_bytes_are_reported_apart_from_the_experts(run):
    _, result = run
    from ondevice_moe.models.tiny import tiny_model

    base = tiny_model("tiny-bert", 257, num_labels=2)
    head_bytes = sum(p.nbytes for n, p in base.named_parameters() if n.startswith(("classifier", "bert.pooler")))
    for name in ("hermes", "fed-lora"):
        method = result.summary["methods"][name]
        devices = len(result.summary["users"])
        assert method["upload_outside_experts_bytes_per_round"] == devices * head_bytes
        assert method["upload_bytes_per_round"] > method["upload_outside_experts_bytes_per_round"]
    assert "of which head (or base)" in (result.run_dir / "report.md").read_text()
