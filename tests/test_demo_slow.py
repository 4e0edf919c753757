"""The demo recipe on the real SmolLM2-135M, shrunk by --set overrides (minutes)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ondevice_moe.cli import app

DEMO = Path(__file__).parent.parent / "recipes" / "demo.yaml"


@pytest.mark.slow
def test_shrunk_demo_on_smollm2(tmp_path):
    overrides = ["federation.rounds=1", "federation.local_iterations=4", "data.train_tokens=4000",
                 "data.valid_tokens=1024", "data.test_tokens=256", "training.router_period=2",
                 "training.router_steps=1", "data.batch_size=2",
                 "methods=[pretrained, {name: comigs, variant: 1G1S}]"]
    args = ["finetune", str(DEMO), "--output", str(tmp_path / "demo")]
    for override in overrides:
        args += ["--set", override]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    pretrained, comigs = summary["methods"]["pretrained"], summary["methods"]["comigs-1G1S"]
    # Real pretrained weights: perplexities far below the ~49k of a random model.
    assert pretrained["mean_in"] < 200
    assert comigs["mean_in"] < pretrained["mean_in"]
