"""Small torch models on scikit-learn digits and synthetic regression, through the same Flower path."""

from pathlib import Path

import pytest
import yaml

from ondevice_moe import runner
from ondevice_moe.errors import UserError
from ondevice_moe.recipe import load_recipe, validate_recipe

TINY_DIGITS = Path(__file__).parent / "recipes" / "tiny-digits.yaml"


def test_fedavg_of_a_whole_mlp_learns_rotated_digits(tmp_path):
    result = runner.run_recipe(load_recipe(TINY_DIGITS), tmp_path / "run")
    methods = result.summary["methods"]
    assert methods["pretrained"]["mean_score"] < 20, "an untrained 10-way classifier sits near chance"
    assert methods["fed-ft"]["mean_score"] > methods["pretrained"]["mean_score"] + 20
    assert methods["fed-ft"]["upload_bytes_per_round"] > 0


def test_regression_scores_are_squared_errors_not_percentages():
    import torch

    from ondevice_moe.federation import device as dev
    from ondevice_moe.federation.evaluation import evaluate_device
    from ondevice_moe.federation.job import Job

    raw = yaml.safe_load(TINY_DIGITS.read_text())
    raw["model"] = {"name": "linear"}
    raw["task"] = {"name": "floral-linear", "clients": 4, "batch_size": 16}
    job = Job(validate_recipe(raw), 0, Path("."))
    model = dev.build_model(job, 1)
    examples = dev.federated_task(job).test[1]
    with torch.no_grad():
        expected = float(((model(**examples.batch(torch.arange(len(examples)))).logits - examples.labels) ** 2).mean())
    assert evaluate_device(job, 1, model)["user_1/score"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(("model", "task"), [("mlp", "rotten-tomatoes"), ("tiny-bert", "digits-rotate")])
def test_models_and_tasks_of_different_kinds_are_refused(model, task):
    raw = yaml.safe_load(TINY_DIGITS.read_text())
    raw["model"] = {"name": model}
    raw["task"] = {"name": task, "clients": 2}
    with pytest.raises(UserError, match="does not fit"):
        validate_recipe(raw)


def test_peft_methods_are_refused_on_small_models():
    raw = yaml.safe_load(TINY_DIGITS.read_text())
    raw["methods"] = ["fed-lora"]
    with pytest.raises(UserError, match="do not run on a small-model recipe"):
        validate_recipe(raw)


def test_the_report_names_the_metric_and_its_direction(tmp_path):
    from ondevice_moe.report import score_title, write_report

    for metric, expected in (("mse", "Test mse after the last round (lower is better)"),
                             ("accuracy", "Test accuracy ×100 after the last round (higher is better)"),
                             ("perplexity", "Test perplexity after the last round (lower is better)")):
        summary = {"users": ["a"], "metric": metric, "methods": {}}
        assert score_title(summary) == expected
        assert expected in write_report(tmp_path, "r", summary, []).read_text()
