"""The command line beyond errors: --version, the recipes verbs, --dry-run and --device."""

from pathlib import Path

import yaml
from typer.testing import CliRunner

import ondevice_moe
from ondevice_moe import BUNDLED_RECIPES
from ondevice_moe.cli import app
from ondevice_moe.plan import plan_recipe
from ondevice_moe.recipe import load_recipe

TESTS = Path(__file__).parent / "recipes"
runner = CliRunner()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"ondevice-moe {ondevice_moe.__version__}"


def test_recipes_list_reads_the_package_folder():
    assert Path(ondevice_moe.__file__).parent / "recipes" == BUNDLED_RECIPES
    result = runner.invoke(app, ["recipes", "list"])
    assert result.exit_code == 0
    for path in BUNDLED_RECIPES.glob("*.yaml"):
        assert path.name in result.output.replace("\n", "")


def test_recipes_show_prints_the_yaml_unchanged():
    result = runner.invoke(app, ["recipes", "show", "demo"])
    assert result.exit_code == 0
    assert result.output.rstrip("\n") == (BUNDLED_RECIPES / "demo.yaml").read_text().rstrip("\n")


def test_recipes_show_unknown_name_lists_the_recipes():
    result = runner.invoke(app, ["recipes", "show", "dem"])
    assert result.exit_code == 2
    assert "no bundled recipe 'dem'" in result.output and "demo" in result.output and "Traceback" not in result.output


def test_recipes_copy_refuses_to_overwrite_without_force(tmp_path):
    bundled = (BUNDLED_RECIPES / "demo.yaml").read_text()
    assert runner.invoke(app, ["recipes", "copy", "demo", str(tmp_path)]).exit_code == 0
    copy = tmp_path / "demo.yaml"
    assert copy.read_text() == bundled
    copy.write_text("name: mine\n")
    refused = runner.invoke(app, ["recipes", "copy", "demo.yaml", str(copy)])
    assert refused.exit_code == 2 and "already exists" in refused.output and "--force" in refused.output
    assert copy.read_text() == "name: mine\n"
    assert runner.invoke(app, ["recipes", "copy", "demo", str(copy), "--force"]).exit_code == 0
    assert copy.read_text() == bundled


def test_a_recipe_copy_is_named_after_its_file_so_its_run_has_its_own_folder(tmp_path):
    bundled = (BUNDLED_RECIPES / "quickstart.yaml").read_text()
    result = runner.invoke(app, ["recipes", "copy", "quickstart", str(tmp_path / "my run.yaml")])
    assert result.exit_code == 0 and "runs/my-run" in " ".join(result.output.split())
    copy = (tmp_path / "my run.yaml").read_text()
    assert load_recipe(tmp_path / "my run.yaml").name == "my-run"  # a space cannot name a folder
    assert copy.replace("name: my-run", "name: quickstart", 1) == bundled  # comments and all else as written


def test_dry_run_prints_recipe_and_plan_and_trains_nothing(tmp_path):
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["finetune", str(TESTS / "tiny.yaml"), "--dry-run", "--device", "cpu",
                                 "--set", "federation.rounds=3", "--output", str(run_dir)])
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.output.split("plan:")[0])
    assert resolved["model"]["device"] == "cpu" and resolved["federation"]["rounds"] == 3
    plan = result.output.split("plan:")[1]
    assert "3 devices, 3 rounds" in " ".join(plan.split())
    for method in ("pretrained", "fedavg", "comigs-1G1S"):
        assert method in plan
    assert "nothing was trained" in result.output
    assert not run_dir.exists()


def test_plan_counts_trained_and_uploaded_parameters():
    recipe = load_recipe(TESTS / "tiny.yaml", ["methods=[pretrained, local, fedavg, comigs]"])
    plans = {plan.name: plan for plan in plan_recipe(recipe, Path("runs"))}
    assert all(len(plan.devices) == 3 for plan in plans.values())
    pretrained, local, fedavg, comigs = (plans[n].devices[0] for n in ("pretrained", "local", "fedavg", "comigs-1G1S"))
    assert (pretrained.trainable, pretrained.uploaded, plans["pretrained"].uploaded_bytes) == (0, 0, 0)
    assert local.trainable > 0 and local.uploaded == 0  # everything stays on the device
    assert fedavg.uploaded == fedavg.trainable > 0
    assert fedavg.uploaded_bytes == 4 * fedavg.uploaded  # float32
    assert 0 < comigs.uploaded < comigs.trainable  # specialists and routers stay home


def test_plan_of_a_classification_recipe():
    recipe = load_recipe(TESTS / "tiny-classification.yaml")
    plans = {plan.name: plan for plan in plan_recipe(recipe, Path("runs"))}
    hermes, fed_lora = plans["hermes"].devices[0], plans["fed-lora"].devices[0]
    assert len(plans["hermes"].devices) == 3
    assert fed_lora.uploaded == fed_lora.trainable > 0  # LoRA and the task head
    assert 0 < hermes.uploaded < hermes.trainable  # the routers are private


def test_progress_shows_time_remaining():
    from rich.progress import TimeRemainingColumn

    from ondevice_moe.cli import _progress

    assert any(isinstance(column, TimeRemainingColumn) for column in _progress().columns)


def test_the_console_summary_names_dropped_devices(capsys):
    from ondevice_moe.cli import _print_summary

    method = {"per_user": {"a": {"in": 1.0, "out": 1.0}, "b": {"in": 1.0, "out": 1.0}}, "mean_in": 1.0,
              "std_in": 0.0, "mean_out": 1.0, "std_out": 0.0, "upload_bytes_per_round": 0.0}
    _print_summary({"users": ["a", "b"], "metric": "perplexity",
                    "methods": {"fedavg": {**method, "dropped": {"b": 2}}, "local": {**method, "dropped": {}}}})
    out = " ".join(capsys.readouterr().out.split())
    assert "dropped: fedavg: b (2 rounds)" in out and "local:" not in out


def test_the_results_table_shows_whole_method_names_on_a_narrow_terminal(monkeypatch):
    from rich.console import Console

    from ondevice_moe import cli

    narrow = Console(width=60, record=True)
    monkeypatch.setattr(cli, "console", narrow)
    entry = {"per_user": {"a": {"in": 2.0, "out": 3.0}}, "mean_in": 2.0, "std_in": 0.0, "mean_out": 3.0,
             "std_out": 0.0, "upload_bytes_per_round": 10.0}
    cli._print_summary({"users": ["a"], "metric": "perplexity", "methods": {"comigs-1GXs-2444": entry}})
    assert "comigs-1GXs-2444" in narrow.export_text()


def test_the_run_header_names_both_seeds_and_whether_the_split_follows_the_seed():
    from ondevice_moe.cli import run_header

    recipe = load_recipe(BUNDLED_RECIPES / "quickstart.yaml", seed=7)
    assert "seed 7, data split seed 7 (follows seed)" in run_header(recipe, ["fedavg"]).plain
    pinned = load_recipe(BUNDLED_RECIPES / "quickstart.yaml", ["data_seed=3"], seed=7)
    assert "seed 7, data split seed 3 (data_seed)" in run_header(pinned, ["fedavg"]).plain


def test_an_instruction_recipes_dry_run_counts_real_tokens_and_the_scored_responses():
    from ondevice_moe.federation.device import user_data
    from ondevice_moe.federation.job import Job
    from ondevice_moe.plan import data_counts

    recipe = load_recipe(TESTS / "tiny-instruct.yaml")
    job = Job(recipe, 0, Path())
    counts = data_counts(job)
    for index, user in enumerate(counts):
        train = user_data(job, index).examples("train")
        assert user.tokens["train"] == int(train.attention_mask.sum()) <= train.blocks.numel()  # padding left out
        assert 0 < user.scored["train"] < user.tokens["train"] and user.instructions  # responses only
    result = runner.invoke(app, ["finetune", str(TESTS / "tiny-instruct.yaml"), "--dry-run"])
    assert result.exit_code == 0 and "scored (responses)" in result.output, result.output
