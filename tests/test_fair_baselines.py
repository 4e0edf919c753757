"""Fair baselines (issue 33): scoring on the validation split to choose a learning rate, the
equal-parameter FedAvg beside FLoRAL and FedSoft, FLoRAL's LoRA scale and preconditioning switch,
and ``eval/lr_sweep.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ondevice_moe import runner
from ondevice_moe.experts.layer import AdaptorKinds, layer_adaptor
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.layout import attach_layout
from ondevice_moe.methods.fedsoft.procedure import CentreProcedure
from ondevice_moe.methods.floral.rule import MixtureRule
from ondevice_moe.methods.registry import method_for
from ondevice_moe.models.tiny import tiny_llama
from ondevice_moe.recipe import load_recipe
from ondevice_moe.report import score_title
from ondevice_moe.server_rules.rules import ServerRule

TESTS = Path(__file__).parent / "recipes"
TINY = TESTS / "tiny.yaml"
sys.path.insert(0, str(Path(__file__).parents[1] / "eval"))


def _trainable(model: nn.Module) -> dict[str, int]:
    return {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}


# -- data.eval_split ----------------------------------------------------------------


def test_eval_split_valid_scores_each_users_validation_blocks():
    test_job = Job(load_recipe(TINY), 0, Path("."))
    valid_job = Job(load_recipe(TINY, ["data.eval_split=valid"]), 0, Path("."))
    for user in range(3):
        data = dev.user_data(valid_job, user)
        assert torch.equal(dev.eval_blocks(valid_job, user), data.valid)
        assert torch.equal(dev.eval_blocks(test_job, user), data.test)
        assert not torch.equal(data.valid[: len(data.test)], data.test[: len(data.valid)])


def test_eval_split_is_test_or_valid():
    from ondevice_moe.errors import UserError

    with pytest.raises((UserError, ValueError), match="eval_split"):
        load_recipe(TINY, ["data.eval_split=train"])


@pytest.fixture(scope="module")
def pretrained_runs(runs_on_each_split):
    """The untrained model scored on each split: no training noise, so the figures differ by the split only."""
    return runs_on_each_split(TINY, "data.eval_split", ["methods=[pretrained]"])


def test_a_validation_run_says_so_in_its_summary_and_report(pretrained_runs):
    valid, test = pretrained_runs["valid"], pretrained_runs["test"]
    assert valid.summary["eval_split"] == "valid" and test.summary["eval_split"] == "test"
    ours, theirs = valid.summary["methods"]["pretrained"], test.summary["methods"]["pretrained"]
    assert ours["mean_in"] != theirs["mean_in"] and ours["mean_out"] != theirs["mean_out"]
    title = valid.report.read_text(encoding="utf-8").splitlines()
    assert any(line.startswith("VALIDATION perplexity") for line in title)
    assert "each user's own validation split" in valid.report.read_text(encoding="utf-8")
    assert "VALIDATION" not in test.report.read_text(encoding="utf-8")
    assert score_title(test.summary).startswith("Test perplexity")


def test_a_run_scored_on_valid_is_rescored_on_test_from_the_same_models(pretrained_runs):
    valid, test = pretrained_runs["valid"], pretrained_runs["test"]
    rescored = runner.evaluate_run(valid.run_dir, split="test")
    assert rescored["eval_split"] == "test"
    for user, values in test.summary["methods"]["pretrained"]["per_user"].items():
        got = rescored["methods"]["pretrained"]["per_user"][user]
        assert got["in"] == pytest.approx(values["in"]) and got["out"] == pytest.approx(values["out"])
    assert runner.evaluate_run(valid.run_dir, methods=[])["methods"] == {}


def test_compare_will_not_mix_splits(pretrained_runs):
    from ondevice_moe.compare import comparison
    from ondevice_moe.errors import UserError

    valid, test = (pretrained_runs[s].run_dir for s in ("valid", "test"))
    assert "VALIDATION split" in comparison([valid])
    with pytest.raises(UserError, match="validation split and some on the test split"):
        comparison([valid, test])
    with pytest.raises(UserError, match="different splits"):
        comparison([Path(f"{valid}+{test}")])


# -- equal trainable parameters ------------------------------------------------------


def test_fedavg_adaptor_at_rank_multiple_c_holds_floral_c_adaptors_lora_parameters():
    base = tiny_llama(257).requires_grad_(False)
    sizes = {"budget": 0.05, "bias": False, "norm": False}
    floral = method_for("floral", 2, clusters=4, **sizes)
    fedavg = method_for("fedavg-adaptor", 2, rank_multiple=4, **sizes)
    floral_params = _trainable(attach_layout(base, floral.layouts[0], seed=0))
    fedavg_params = _trainable(attach_layout(base, fedavg.layouts[0], seed=0))
    floral_lora = sum(n for name, n in floral_params.items() if name != "router.theta")
    assert sum(fedavg_params.values()) == floral_lora
    # the same layers: every LoRA of FedAvg's one adaptor sits where FLoRAL's four do, at four times the rank
    assert {name.replace("shared_0", "*") for name in fedavg_params} == \
        {name.replace(f"shared_{c}", "*") for name in floral_params if name != "router.theta" for c in range(4)
         if f"shared_{c}" in name}
    assert fedavg.name == "fedavg-adaptor" and type(fedavg.server_rule) is ServerRule
    assert isinstance(floral.server_rule, MixtureRule)
    assert not fedavg.procedure.lora_preconditioning and fedavg.layouts[0].router.kind == "none"


def test_lora_scale_scales_floral_adaptors_residual():
    layer = nn.Linear(32, 48)
    generator = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    plain = layer_adaptor(layer, AdaptorKinds(budget=0.1, bias=False), generator()).low_rank
    scaled = layer_adaptor(layer, AdaptorKinds(budget=0.1, bias=False, lora_scale=0.25), generator()).low_rank
    double = layer_adaptor(layer, AdaptorKinds(budget=0.1, bias=False, rank_multiple=2), generator()).low_rank
    assert plain.rank == scaled.rank and double.rank == 2 * plain.rank
    with torch.no_grad():
        for lora in (plain, scaled):
            lora.lora_B.copy_(torch.randn(lora.lora_B.shape, generator=generator()))
    x = torch.randn(3, 32)
    torch.testing.assert_close(scaled(x), 0.25 * plain(x))
    method = method_for("floral", 2, clusters=1, lora_scale=0.25, budget=0.05, norm=False)
    assert method.layouts[0].adaptor_kinds.lora_scale == 0.25


def test_rank_multiple_and_lora_scale_refuse_convolutions():
    from ondevice_moe.errors import UserError

    with pytest.raises(UserError, match="ConvLoRA"):
        layer_adaptor(nn.Conv2d(3, 8, 3), AdaptorKinds(budget=0.1, rank_multiple=2), torch.Generator())


def test_fedavg_cluster_adapter_trains_fedsofts_own_lora():
    base = tiny_llama(257).requires_grad_(False)
    fedsoft = method_for("fedsoft", 4, clusters=2, lora_rank=4)
    fedavg = method_for("fedavg-cluster-adapter", 4, lora_rank=4)
    fedlora = method_for("fed-lora", 4, lora_rank=4)
    ours = _trainable(attach_layout(base, fedavg.layouts[0], seed=0))
    assert ours == _trainable(attach_layout(base, fedsoft.layouts[0], seed=0))
    assert sum(ours.values()) == 2 * sum(_trainable(attach_layout(base, fedlora.layouts[0], seed=0)).values())
    assert any("k_proj" in name for name in ours) and any("o_proj" in name for name in ours)
    assert type(fedavg.server_rule) is ServerRule and not isinstance(fedavg.procedure, CentreProcedure)


def test_the_language_model_recipes_hold_an_equal_parameter_fedavg():
    floral = load_recipe(Path(__file__).parents[1] / "recipes" / "floral-smollm2.yaml")
    fedsoft = load_recipe(Path(__file__).parents[1] / "recipes" / "fedsoft-smollm2.yaml")
    assert "fedavg-adaptor" in [floral.method(i).name for i in range(len(floral.methods))]
    assert "fedavg-qkvo" in [fedsoft.method(i).name for i in range(len(fedsoft.methods))]


# -- preconditioning -----------------------------------------------------------------


def test_a_floral_entry_switches_preconditioning():
    recipe = load_recipe(TESTS / "tiny-floral.yaml", [
        'methods=[floral, {name: floral, preconditioning: false, label: floral-no-precond}]'])
    on, off = recipe.method(0), recipe.method(1)
    assert on.procedure.lora_preconditioning and not off.procedure.lora_preconditioning
    assert off.name == "floral-no-precond"


# -- eval/lr_sweep.py ----------------------------------------------------------------


def _summary(split: str, values: dict[str, float]) -> dict:
    return {"users": ["a"], "metric": "perplexity", "eval_split": split,
            "methods": {m: {"mean_in": v, "mean_out": 2 * v, "std_in": 0.0, "std_out": 0.0, "upload_bytes_per_round": 0,
                            "per_user": {"a": {"in": v, "out": 2 * v}}} for m, v in values.items()}}


def test_sweep_table_picks_each_methods_lowest_validation_rate_and_flags_an_edge():
    import lr_sweep

    summaries = {5e-4: _summary("valid", {"a": 30.0, "b": 20.0}), 2e-3: _summary("valid", {"a": 25.0, "b": 21.0}),
                 8e-3: _summary("valid", {"a": 27.0, "b": float("nan")})}
    table, best = lr_sweep.sweep_table(summaries, "in")
    assert best == {"a": 2e-3, "b": 5e-4}
    assert "| a | 30.00 / 60.00 | 25.00 / 50.00 | 27.00 / 54.00 | 0.002 |" in table
    assert "0.0005 (edge of the grid)" in table and "diverged" in table


def test_a_method_that_failed_at_a_rate_is_chosen_among_the_rates_it_finished():
    import lr_sweep

    summaries = {2e-3: _summary("valid", {"a": 25.0, "b": 21.0}), 8e-3: _summary("valid", {"b": 20.0})}
    table, best = lr_sweep.sweep_table(summaries, "in")
    assert best == {"a": 2e-3, "b": 8e-3}
    assert "| a | 25.00 / 50.00 | failed | 0.002 (edge of the grid) |" in table


def test_a_failing_run_is_reported_and_the_sweep_goes_on(tmp_path, capsys):
    import lr_sweep

    folder = tmp_path / "valid-lr0.008-s0"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(_summary("valid", {"b": 20.0})))
    failing = [sys.executable, "-c", "import sys; sys.exit(3)"]
    lr_sweep.run(failing, folder, tmp_path, dry_run=False, methods=["a", "b"])  # "a" unfinished: runs again
    printed = capsys.readouterr().out
    assert "exit status 3" in printed and "before a finished" in printed and "Traceback" not in printed
    lr_sweep.run(failing, folder, tmp_path, dry_run=False, methods=["b"])
    assert "kept:" in capsys.readouterr().out
    assert lr_sweep.read_summary(tmp_path / "never-ran", "valid")["methods"] == {}


def test_lr_sweep_refuses_a_test_run_as_a_validation_run(tmp_path):
    import lr_sweep

    (tmp_path / "summary.json").write_text(json.dumps(_summary("test", {"a": 1.0})))
    with pytest.raises(SystemExit, match="scored on the test split, not valid"):
        lr_sweep.read_summary(tmp_path, "valid")


@pytest.mark.slow
def test_lr_sweep_on_a_tiny_recipe_chooses_on_valid_and_tests_the_choice(tmp_path, capsys, monkeypatch):
    import lr_sweep

    monkeypatch.chdir(Path(__file__).parents[1])
    out = tmp_path / "sweep"
    sets = ["--set", "federation.rounds=1", "--set", "methods=[local, fedavg]"]
    lr_sweep.main([str(TINY), "--rates", "1e-4", "3e-2", "--out", str(out), *sets,
                   "--test-seeds", "0", "1", "--against", "fedavg"])
    printed = capsys.readouterr().out
    best = json.loads((out / "best_rates.json").read_text())
    assert set(best) == {"local", "fedavg"}
    for rate in (1e-4, 3e-2):
        summary = json.loads((out / f"valid-lr{rate:g}-s0" / "summary.json").read_text())
        assert summary["eval_split"] == "valid"
    for method, rate in best.items():
        for seed in (0, 1):
            summary = json.loads((out / f"test-lr{rate:g}-s{seed}" / "summary.json").read_text())
            assert summary["eval_split"] == "test" and method in summary["methods"]
    assert "best rate per method on valid" in printed and "mean Δ% vs fedavg" in printed
    # seed 0 (the sweep's) is re-scored from the sweep's checkpoints: the figures of training on test
    rate = best["fedavg"]
    rescored = json.loads((out / f"test-lr{rate:g}-s0" / "summary.json").read_text())
    assert rescored["rescored_from"].endswith(f"valid-lr{rate:g}-s0")
    recipe = load_recipe(TINY, ["federation.rounds=1", "methods=[fedavg]", f"training.lr={rate!r}"], seed=0)
    direct = runner.run_recipe(recipe, tmp_path / "direct").summary["methods"]["fedavg"]
    assert rescored["methods"]["fedavg"]["mean_in"] == pytest.approx(direct["mean_in"], rel=1e-4)
    assert rescored["methods"]["fedavg"]["mean_out"] == pytest.approx(direct["mean_out"], rel=1e-4)
