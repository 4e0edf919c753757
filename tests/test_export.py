"""``ondevice-moe export`` on a finished tiny run (its base a local model folder): the toolkit
format reproduces the run's metrics, the PEFT adapter loads by itself, private experts stay home
by default, the card, the Hub, and bad input."""

import json
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

import ondevice_moe
from ondevice_moe.cli import app
from ondevice_moe.errors import UserError
from ondevice_moe.export.toolkit_format import WRITTEN_LIST
from ondevice_moe.federation.evaluation import evaluate_device, user_values
from ondevice_moe.federation.job import Job
from ondevice_moe.recipe import load_recipe
from ondevice_moe.report import MetricsLog

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_run(tiny_llama_run):
    return tiny_llama_run


def _export(run: Path, to: Path, *options: str, method: str = "comigs-1G1S", user: str = "news"):
    result = runner.invoke(app, ["export", str(run), "--method", method, "--user", user, "--to", str(to), *options])
    assert "Traceback" not in result.output
    return result


def _front_matter(folder: Path) -> dict:
    return yaml.safe_load((folder / "README.md").read_text().split("---\n")[1])


def test_the_whole_model_reproduces_the_runs_test_metrics(tiny_run, tmp_path):
    result = _export(tiny_run, tmp_path / "out", "--experts", "all")
    assert result.exit_code == 0, result.output
    model = ondevice_moe.load_adapted(None, tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "export.json").read_text())
    job = Job(load_recipe(tmp_path / "out" / "recipe.yaml"), manifest["method_index"], tmp_path / "out")
    values = user_values(evaluate_device(job, manifest["device"], model), 1)
    logged = [r for r in MetricsLog(tiny_run / "metrics.jsonl").read()
              if r["kind"] == "eval" and r["method"] == "comigs-1G1S" and r["user"] == "news"][-1]
    summary = json.loads((tiny_run / "summary.json").read_text())["methods"]["comigs-1G1S"]["per_user"]["news"]
    assert values["test_ppl_in"] == logged["test_ppl_in"] == summary["in"]
    assert values["test_ppl_out"] == logged["test_ppl_out"] == summary["out"]


def test_the_loaded_model_generates(tiny_run, tmp_path):
    assert _export(tiny_run, tmp_path / "out", "--experts", "all", "--format", "toolkit").exit_code == 0
    assert not list((tmp_path / "out").glob("**/adapter_config.json"))
    model = ondevice_moe.load_adapted(None, tmp_path / "out")
    prompt = torch.tensor([[72, 101, 108, 108, 111]])
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=256)
    assert generated.shape == (1, 9) and torch.equal(generated[:, :5], prompt)


def test_private_experts_stay_home_by_default(tiny_run, tmp_path):
    result = _export(tiny_run, tmp_path / "out")
    assert result.exit_code == 0, result.output
    tensors = load_file(str(tmp_path / "out" / "experts.safetensors"))
    assert tensors and not any("private" in name or "router" in name for name in tensors)
    assert [p.parent for p in (tmp_path / "out").glob("**/adapter_config.json")] == [tmp_path / "out"]
    parts = json.loads((tmp_path / "out" / "export.json").read_text())["parts"]
    assert {name: part["exported"] for name, part in parts.items()} == {
        "shared": True, "shared_0": True, "private_0": False, "router": False}
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Private parts (private_0, router) are the user's own and were left out" in card


def test_the_card_describes_the_run(tiny_run, tmp_path, saved_tiny_models):
    assert _export(tiny_run, tmp_path / "out", "--experts", "all").exit_code == 0
    meta = _front_matter(tmp_path / "out")
    summary = json.loads((tiny_run / "summary.json").read_text())["methods"]["comigs-1G1S"]["per_user"]["news"]
    assert meta["library_name"] == "peft"
    assert "base_model" not in meta and "license" not in meta  # a local folder: no Hub repository, no known licence
    assert [m["value"] for m in meta["model-index"][0]["results"][0]["metrics"]] == [summary["in"], summary["out"]]
    run = meta["ondevice_moe"]
    assert (run["method"], run["rounds"], run["devices"], run["seed"]) == ("comigs-1G1S", 1, 3, 0)
    assert run["base_model"] == {"name": str(saved_tiny_models["tiny-llama"]), "source": "a local folder",
                                 "dtype": "float32"}
    assert {"ondevice-moe", "peft", "flwr"} <= set(run["versions"])
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Private parts included** (private_0, router)" in card
    assert "A routed mixture has no exact PEFT form" in card and "name: tiny" in card


def test_peft_only_writes_adapters_and_the_card(tiny_run, tmp_path):
    result = _export(tiny_run, tmp_path / "out", "--format", "peft", method="fedavg-two-lora")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        WRITTEN_LIST, "README.md", "adapter_config.json", "adapter_model.safetensors"]
    card = (tmp_path / "out" / "README.md").read_text()
    assert "load_adapted(None" not in card and "A mixture of MLP experts has no exact PEFT form" in card


def test_fedavgs_export_loads_by_itself_and_scores_the_runs_perplexity(tiny_run, tmp_path, saved_tiny_models):
    """FedAvg is one LoRA per targeted module: AutoPeftModelForCausalLM, finding the base by the name the
    export wrote (here a local folder), gives the user's test perplexity of the run to float tolerance (PEFT
    adds its LoRA product in its own order, so the last digits may differ by machine)."""
    from peft import AutoPeftModelForCausalLM

    from ondevice_moe.federation import device as dev
    from ondevice_moe.likelihood import score_blocks
    from ondevice_moe.run_model import open_user_model

    assert _export(tiny_run, tmp_path / "out", "--format", "peft", method="fedavg").exit_code == 0
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(saved_tiny_models["tiny-llama"])
    assert "holds the whole adapted model: no router mixes experts" in (tmp_path / "out" / "README.md").read_text()
    job = open_user_model(tiny_run, "fedavg", "news").job
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "out")
    perplexity = score_blocks(loaded, dev.eval_examples(job, 1), 8).perplexity()
    logged = [r for r in MetricsLog(tiny_run / "metrics.jsonl").read()
              if r["kind"] == "eval" and r["method"] == "fedavg" and r["user"] == "news"][-1]
    assert perplexity == pytest.approx(logged["test_ppl_in"], rel=1e-5)


def test_force_never_touches_a_folder_no_export_wrote(tiny_run, tmp_path):
    mine = tmp_path / "mine"
    (mine / "photos").mkdir(parents=True)
    (mine / "README.md").write_text("my notes")
    (mine / "photos" / "adapter_config.json").write_text("{}")  # looks like an adapter, is not ours
    result = _export(tiny_run, mine, "--force")
    assert result.exit_code == 2 and "holds files that no ondevice-moe export wrote" in " ".join(result.output.split())
    assert (mine / "README.md").read_text() == "my notes" and (mine / "photos" / "adapter_config.json").exists()


def test_force_removes_only_what_the_earlier_export_listed_and_follows_no_link(tiny_run, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    assert _export(tiny_run, tmp_path / "out", "--experts", "all").exit_code == 0
    (tmp_path / "out" / "notes.txt").write_text("mine")  # added by the user after the export
    listed = json.loads((tmp_path / "out" / WRITTEN_LIST).read_text())
    adapter = next(name for name in listed if (tmp_path / "out" / name).is_dir())
    shutil.rmtree(tmp_path / "out" / adapter)
    (tmp_path / "out" / adapter).symlink_to(outside)  # a link where a listed adapter folder stood
    (tmp_path / "out" / "README.md").unlink()
    (tmp_path / "out" / "README.md").symlink_to(outside / "keep.txt")  # a planted link where the card goes
    result = _export(tiny_run, tmp_path / "out", "--force")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine" and (outside / "keep.txt").read_text() == "keep"
    assert not (tmp_path / "out" / "README.md").is_symlink()


def test_force_replaces_an_earlier_export(tiny_run, tmp_path):
    assert _export(tiny_run, tmp_path / "out", "--experts", "all").exit_code == 0
    assert sorted(p.parent.name for p in (tmp_path / "out").glob("*/adapter_config.json")) == ["private_0", "shared_0"]
    result = _export(tiny_run, tmp_path / "out", "--force")
    assert result.exit_code == 0, result.output
    assert [p.parent for p in (tmp_path / "out").glob("**/adapter_config.json")] == [tmp_path / "out"]


@pytest.mark.parametrize(("options", "expected"), [
    (["--method", "fedprox"], "use one of: fedavg, comigs-1G1S"),
    (["--user", "sports"], "use one of: code, news, reviews"),
    (["--experts", "shared_7"], "use one of: shared, all, shared, shared_0, private_0, router"),
    (["--experts", "private_0"], "pass --experts all to export private experts too"),
    (["--format", "onnx"], "use one of: both, toolkit, peft"),
])
def test_bad_input_is_one_message(tiny_run, tmp_path, options, expected):
    args = {"--method": "comigs-1G1S", "--user": "news", "--to": str(tmp_path / "out")}
    rest = []
    for key, value in zip(options[::2], options[1::2], strict=True):
        if key in args:
            args[key] = value
        else:
            rest += [key, value]
    result = runner.invoke(app, ["export", str(tiny_run), *[x for kv in args.items() for x in kv], *rest])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert expected in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()


def test_a_non_empty_folder_needs_force(tiny_run, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    result = _export(tiny_run, tmp_path / "out")
    assert result.exit_code == 2 and "pass --force" in " ".join(result.output.split())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["notes.txt"]


def test_a_run_that_has_not_finished_is_refused(tiny_run, tmp_path):
    (tmp_path / "run").mkdir()
    shutil.copy(tiny_run / "recipe.yaml", tmp_path / "run" / "recipe.yaml")
    result = _export(tmp_path / "run", tmp_path / "out")
    assert result.exit_code == 2 and "has finished" in result.output


def test_offline_push_fails_at_once(tiny_run, tmp_path):
    import huggingface_hub

    assert huggingface_hub.is_offline_mode()  # conftest sets HF_HUB_OFFLINE=1 before the hub is imported
    result = _export(tiny_run, tmp_path / "out", "--push-to-hub", "org/name")
    assert result.exit_code == 2 and "offline mode is on (HF_HUB_OFFLINE=1)" in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()


def test_push_creates_the_repo_and_uploads_the_folder(tiny_run, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def create_repo(repo_id, private=None, exist_ok=False):
        calls.append(("create", repo_id, private, exist_ok))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(repo_id, folder_path, commit_message=None, ignore_patterns=()):
        calls.append(("upload", repo_id, sorted(p.name for p in Path(folder_path).iterdir()
                                                if not any(fnmatch(p.name, pattern) for pattern in ignore_patterns))))

    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    monkeypatch.setattr(huggingface_hub, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub, "upload_folder", upload_folder)
    result = _export(tiny_run, tmp_path / "out", "--push-to-hub", "org/name", "--private")
    assert result.exit_code == 0, result.output
    assert calls == [("create", "org/name", True, True),
                     ("upload", "org/name",
                      ["README.md", "adapter_config.json", "adapter_model.safetensors", "experts.safetensors",
                       "export.json", "recipe.yaml"])]
    assert _front_matter(tmp_path / "out")["model-index"][0]["name"] == "org/name"


@pytest.mark.parametrize(("change", "expected"), [({"method_index": "0; rm -rf /"}, "missing or of the wrong kind"),
                                                  ({"device": 99}, "names a method or device"),
                                                  ({"method_index": True}, "missing or of the wrong kind")])
def test_a_tampered_export_manifest_is_one_message(tiny_run, tmp_path, change, expected):
    assert _export(tiny_run, tmp_path / "out").exit_code == 0
    manifest = tmp_path / "out" / "export.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), **change}))
    with pytest.raises(UserError, match=expected):
        ondevice_moe.load_adapted(None, tmp_path / "out")


def _holding(code: str, folder: Path) -> subprocess.Popen:
    """Another process that holds ``folder`` (``code``: the ``with`` line) until killed."""
    program = ("import sys, time; from pathlib import Path\n"
               "from ondevice_moe.folder_lock import folder_held; from ondevice_moe.run_folder import run_lock\n"
               f"{code}:\n    print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", program, str(folder)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_export_into_a_folder_being_written_is_refused_not_interleaved(tiny_run, tmp_path):
    to = tmp_path / "out"
    to.mkdir()
    holder = _holding("with folder_held(Path(sys.argv[1]))", to)
    try:
        result = _export(tiny_run, to)
    finally:
        holder.kill()
        holder.wait()
    assert result.exit_code == 2 and "another export is writing to" in result.output
    assert list(to.iterdir()) == []
    assert _export(tiny_run, to).exit_code == 0  # once the other is gone


def test_eval_while_a_run_trains_scores_the_finished_methods_and_names_the_unfinished(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    log = run / "metrics.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()
                           if not ('"done"' in line and '"comigs-1G1S"' in line)))  # comigs still training
    holder = _holding("with run_lock(Path(sys.argv[1]))", run)
    try:
        result = runner.invoke(app, ["eval", str(run)])
    finally:
        holder.kill()
        holder.wait()
    seen = " ".join(result.output.split())
    assert result.exit_code == 0, seen
    assert "a run is still training" in seen and "comigs-1G1S unfinished and not scored" in seen
    assert "fedavg" in seen


def test_files_too_big_to_score_or_show_are_refused_before_they_are_read(tiny_run, tmp_path):
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as file:
        file.truncate(2 * 2**30)  # 2 GiB, sparse: nothing is written, and nothing may be read
    result = runner.invoke(app, ["eval", str(tiny_run), "--data", str(huge), "--out", str(tmp_path / "e.json")])
    assert result.exit_code == 2 and "eval reads at most 256 MiB" in " ".join(result.output.split())
    result = runner.invoke(app, ["inspect", str(tiny_run), "--method", "comigs-1G1S", "--user", "news", "--to",
                                 str(tmp_path / "page.html"), "--file", str(huge)])
    assert result.exit_code == 2 and "a routing page shows at most 256 KiB" in " ".join(result.output.split())
