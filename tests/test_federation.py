"""A real Flower simulation: three devices, a tiny GPT-2, three methods."""

import json
import math
from pathlib import Path

import pytest
from eval_scripts import load_eval_script

from ondevice_moe import runner
from ondevice_moe.federation import strategy
from ondevice_moe.recipe import load_recipe

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    received: list[str] = []
    original = strategy.Update

    def recording_update(device, tensors, num_examples, *records):
        received.extend(tensors)
        return original(device, tensors, num_examples, *records)

    strategy.Update = recording_update
    try:
        recipe = load_recipe(TINY)
        result = runner.run_recipe(recipe, tmp_path_factory.mktemp("run") / "tiny")
    finally:
        strategy.Update = original
    return recipe, result, received


def test_every_method_reports_every_user(tiny_run):
    recipe, result, _ = tiny_run
    users = [u.name for u in recipe.data.users]
    assert list(result.summary["methods"]) == ["pretrained", "fedavg", "comigs-1G1S"]
    for method in result.summary["methods"].values():
        assert set(method["per_user"]) == set(users)
        assert all(0 < values["nll_se_in"] < 1 for values in method["per_user"].values())


def test_training_lowers_perplexity(tiny_run):
    _, result, _ = tiny_run
    methods = result.summary["methods"]
    for name in ("fedavg", "comigs-1G1S"):
        assert methods[name]["mean_in"] < methods["pretrained"]["mean_in"]


def test_private_tensors_never_reach_the_server(tiny_run):
    _, _, received = tiny_run
    assert received, "no shared tensors were received"
    assert not [n for n in received if "private" in n or ".router." in n]


def test_comigs_uploads_less_than_fedavg(tiny_run):
    _, result, _ = tiny_run
    methods = result.summary["methods"]
    assert 0 < methods["comigs-1G1S"]["upload_bytes_per_round"] < methods["fedavg"]["upload_bytes_per_round"]


def test_run_folder_holds_recipe_metrics_report_and_plots(tiny_run):
    _, result, _ = tiny_run
    run_dir = result.run_dir
    for name in ("recipe.yaml", "metrics.jsonl", "summary.json", "report.md", "plots/rounds.png",
                 "plots/expert_scores_comigs-1G1S.png"):
        assert (run_dir / name).exists(), name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in records}
    assert {"train", "eval", "comm"} <= kinds
    scores = [k for r in records if r["kind"] == "train" and r["method"] == "comigs-1G1S" for k in r
              if k.startswith("layer_")]
    assert "layer_0/expert_shared_0_score" in scores
    assert "| comigs-1G1S |" in (run_dir / "report.md").read_text()


def test_rerun_resumes_without_retraining(tiny_run, monkeypatch):
    recipe, result, _ = tiny_run

    def must_not_run(*_):
        raise AssertionError("a finished method was simulated again")

    monkeypatch.setattr(runner, "_simulate", must_not_run)
    again = runner.run_recipe(recipe, result.run_dir)
    assert again.summary == result.summary


def test_other_recipe_in_same_folder_is_refused(tiny_run):
    from ondevice_moe.errors import UserError

    recipe, result, _ = tiny_run
    changed = recipe.model_copy(update={"seed": recipe.seed + 1})
    with pytest.raises(UserError, match="different recipe"):
        runner.run_recipe(changed, result.run_dir)


def test_same_seed_gives_the_same_numbers(tiny_run, tmp_path):
    recipe, result, _ = tiny_run
    again = runner.run_recipe(recipe.model_copy(update={"methods": recipe.methods[1:2]}), tmp_path / "again")
    assert again.summary["methods"]["fedavg"] == result.summary["methods"]["fedavg"]


def test_an_evaluation_riding_on_the_next_rounds_training_gives_the_same_figures(tiny_run, tmp_path):
    recipe, result, _ = tiny_run
    riding = recipe.model_copy(update={"methods": recipe.methods[2:3], "federation": recipe.federation.model_copy(
        update={"evaluation_rides": True})})
    lines: list[str] = []
    again = runner.run_recipe(riding, tmp_path / "riding", on_round=lambda done, total, line: lines.append(line))
    assert again.summary["methods"]["comigs-1G1S"] == result.summary["methods"]["comigs-1G1S"]

    def evaluations(run_dir: Path) -> list[dict]:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k != "time"} for r in records
                if r.get("kind") == "eval" and r["method"] == "comigs-1G1S"]

    assert [r["round"] for r in evaluations(again.run_dir)] == [1, 1, 1, 2, 2, 2]
    assert evaluations(again.run_dir) == evaluations(result.run_dir)
    # round 1's evaluation was read from round 2's training replies; the last round's had its own exchange
    assert any("after round 1" in line for line in lines if line.startswith("round 2"))


def test_compare_over_runs(tiny_run):
    from ondevice_moe.compare import comparison

    _, result, _ = tiny_run
    table = comparison([result.run_dir, result.run_dir])
    mean = result.summary["methods"]["comigs-1G1S"]["mean_in"]
    assert f"| comigs-1G1S | {mean:.2f} (0.00) |" in table


def test_block_pairs_reproduce_the_runs_perplexity_gaps_block_by_block(tiny_run, capsys):
    block_pairs = load_eval_script("block_pairs")
    _, result, _ = tiny_run
    methods = result.summary["methods"]
    gaps = block_pairs.block_gaps(result.run_dir, "comigs-1G1S", "fedavg")
    for user, pair in gaps.items():
        ours, theirs = methods["comigs-1G1S"]["per_user"][user], methods["fedavg"]["per_user"][user]
        for key in ("in", "out"):
            mean, error = block_pairs.describe(pair[key])
            assert mean == pytest.approx(100 * math.log(ours[key] / theirs[key]), abs=1e-3)
            assert error > 0
    same = block_pairs.block_gaps(result.run_dir, "fedavg", "fedavg")
    assert all(not pair["in"].any() for pair in same.values())
    with pytest.raises(SystemExit, match="method 'nope' has not finished"):
        block_pairs.main([str(result.run_dir), "--method", "nope", "--against", "fedavg"])


def test_eval_command_recomputes_final_perplexities(tiny_run):
    from typer.testing import CliRunner

    from ondevice_moe.cli import app

    _, result, _ = tiny_run
    for device in ([], ["--device", "cpu"]):
        outcome = CliRunner().invoke(app, ["eval", str(result.run_dir), "--suite", "lm", *device])
        assert outcome.exit_code == 0, outcome.output
        for name in ("fedavg", "comigs-1G1S"):
            assert f"{result.summary['methods'][name]['mean_in']:.2f}" in outcome.output
    wrong = CliRunner().invoke(app, ["eval", str(result.run_dir), "--suite", "glue"])
    assert wrong.exit_code == 2 and "use --suite lm" in wrong.output
    rescored = runner.evaluate_run(result.run_dir)["methods"]
    for name, entry in result.summary["methods"].items():  # a re-scoring keeps what the training sent
        for key in ("rounds", "upload_bytes_per_round", "download_bytes_per_round", "dropped"):
            assert rescored[name][key] == entry[key], (name, key)
    assert rescored["fedavg"]["upload_bytes_per_round"] > 0


def test_corrupt_checkpoint_is_named(tiny_run, tmp_path):
    import shutil

    from typer.testing import CliRunner

    from ondevice_moe.cli import app

    _, result, _ = tiny_run
    copy = tmp_path / "copy"
    shutil.copytree(result.run_dir, copy)
    (copy / "checkpoints" / "fedavg" / "device_1.safetensors").write_bytes(b"not a checkpoint")
    outcome = CliRunner().invoke(app, ["eval", str(copy), "--suite", "lm"])
    assert outcome.exit_code == 2
    assert "device_1.safetensors is unreadable" in " ".join(outcome.output.split())


def test_heterogeneous_rank_baselines_run_through_flower(tmp_path):
    recipe = load_recipe(TINY, ["methods=[pretrained, {name: hetlora, ranks: [4, 8, 8]}, "
                                "{name: flexlora, ranks: [4, 8, 8]}, "
                                "{name: hetlora, ranks: [4, 8, 8], pruning_lambda: 0.05, label: hetlora-pruning}]"])
    methods = runner.run_recipe(recipe, tmp_path / "ranks").summary["methods"]
    for name in ("hetlora", "flexlora", "hetlora-pruning"):
        assert methods[name]["mean_in"] < methods["pretrained"]["mean_in"]
        assert methods[name]["upload_bytes_per_round"] > 0
