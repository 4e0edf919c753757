"""The Python API (docs/api.md): every ```python block of the page runs, and what it shows holds;
``finetune`` and ``load_recipe`` apply overrides and use the run folder as the CLI does;
``get_mixture_model`` trains only experts and routers, builds what the recipe's ``mixture`` method
builds, and turns a bad config into one ``UserError``."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import ondevice_moe
from ondevice_moe.api import _FEDERATION_ONLY, FinetuneResult, MixtureConfig, SequentialHost, get_mixture_model
from ondevice_moe.errors import UserError
from ondevice_moe.methods.registry import method_spec
from ondevice_moe.report import MetricsLog
from ondevice_moe.run_folder import RunResult

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "api.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def _blocks() -> list[tuple[int, str]]:
    text = DOC.read_text(encoding="utf-8")
    return [(text.count("\n", 0, match.start()) + 1, match.group(1)) for match in FENCE.finditer(text)]


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    """Run docs/api.md's python blocks in order, in one namespace, in a fresh folder."""
    folder = tmp_path_factory.mktemp("docs-api")
    namespace: dict = {"__name__": "docs_api"}
    ran = []
    before = Path.cwd()
    os.chdir(folder)
    try:
        for line, code in _blocks():
            exec(compile(code, f"{DOC}:{line}", "exec"), namespace)  # a failing block names its line
            ran.append(line)
    finally:
        os.chdir(before)
    namespace["_folder"], namespace["_ran"] = folder, ran
    return namespace


# -- the page ----------------------------------------------------------------------------


def test_every_python_block_of_the_page_runs(doc):
    assert len(doc["_ran"]) == len(_blocks()) >= 6


def test_the_pages_finetune_wrote_a_run_with_its_overrides(doc):
    result = doc["result"]
    assert isinstance(result, FinetuneResult)
    assert result.run_dir.resolve() == (doc["_folder"] / "runs" / "demo-tiny").resolve()
    assert result.methods == ["comigs-1G1S"]
    saved = yaml.safe_load((result.run_dir / "recipe.yaml").read_text())
    assert (saved["model"]["name"], saved["federation"]["rounds"], saved["seed"]) == ("tiny-gpt2", 2, 1)
    assert result.recipe.federation.local_iterations == saved["federation"]["local_iterations"] == 2
    records = result.records()
    assert records == MetricsLog(result.run_dir / "metrics.jsonl").read()
    evals = {(r["round"], r["user"]) for r in records if r["kind"] == "eval"}
    assert {(2, user) for user in result.recipe.user_names} <= evals
    assert json.loads((result.run_dir / "summary.json").read_text())["methods"] == result.summary["methods"]
    assert result.report.is_file() and result.report.parent == result.run_dir


def test_the_pages_load_recipe_applies_text_overrides_and_the_seed(doc):
    recipe = doc["recipe"]
    assert (recipe.federation.rounds, recipe.seed) == (10, 2)
    assert [m.name for m in recipe.methods] == ["local", "fedavg"]


def test_the_pages_adapted_model_is_the_exported_users_model(doc):
    folder = doc["_folder"] / "exports" / "news"
    assert json.loads((folder / "export.json").read_text())["user"] == "news"
    again = ondevice_moe.load_adapted(None, folder)  # the base as the folder's recipe loads it
    ids = doc["ids"]
    with torch.no_grad():
        ours, theirs, plain = doc["model"](ids).logits, again(ids).logits, doc["base"].model(ids).logits
    assert torch.equal(ours, theirs)
    assert not torch.allclose(ours, plain)  # the trained experts change what the base computes
    assert not any(p.requires_grad for p in doc["base"].model.parameters())
    assert doc["news_perplexity"] == pytest.approx(doc["model"](ids, labels=ids).loss.exp().item())


def test_the_pages_language_model_trains_only_its_experts_and_routers(doc):
    lm, mixture, trainable = doc["lm"].model, doc["mixture"], doc["trainable"]
    blocks, hidden = lm.config.n_layer, lm.config.n_embd
    inner, rank = 4 * hidden, 4
    lora = rank * (hidden + inner) * 2  # c_fc (hidden -> inner) and c_proj (inner -> hidden)
    router = hidden * 2  # a linear gate to the two experts
    assert sum(p.numel() for p in trainable.values()) == blocks * (2 * lora + router)
    assert all(".experts.shared_0." in n or ".experts.private_0." in n or ".router." in n for n in trainable)
    assert sum(p.numel() for p in mixture.parameters()) == sum(p.numel() for p in lm.parameters()) + (
        blocks * (2 * lora + router))
    assert doc["losses"][-1] < doc["losses"][0] - 0.05


def test_the_pages_classifier_trains_its_head_and_experts_on_frozen_minilm(doc):
    classifier, encoder = doc["classifier"], doc["encoder"]
    assert doc["trained"] == ["bert", "classifier"]
    trainable = [n for n, p in classifier.named_parameters() if p.requires_grad]
    assert all(n.startswith("classifier.") or "shared_" in n or ".router." in n for n in trainable)
    assert any(".query." in n for n in trainable) and any("ffn" in n or "output.dense" in n for n in trainable)
    # the head was copied, so the encoder's own head kept its weights; the shared base did not move
    assert not torch.equal(classifier.classifier.weight, encoder.classifier.weight)
    assert classifier.bert.embeddings.word_embeddings.weight is encoder.bert.embeddings.word_embeddings.weight


def test_the_pages_sequential_model_is_wrapped_with_adaptors_and_a_mixture(doc):
    small = doc["small"]
    assert isinstance(small, SequentialHost) and small.net is not doc["net"]
    trainable = [n for n, p in small.named_parameters() if p.requires_grad]
    assert trainable and all(".adapters." in n or n.startswith("router.") for n in trainable)
    assert "router.theta" in trainable


def test_the_pages_bad_config_gives_one_message_with_its_fix(doc):
    assert "prefix" in doc["message"] and "fix: use `mixing: block`" in doc["message"]


# -- finetune and load_recipe ---------------------------------------------------------------


def test_finetune_into_a_finished_folder_trains_nothing_and_returns_its_results(doc):
    result = doc["result"]
    lines = result.metrics_file.read_text()
    again = ondevice_moe.finetune(result.recipe, output=result.run_dir)  # a Recipe, as the first run resolved it
    assert again.summary["methods"] == result.summary["methods"]
    assert result.metrics_file.read_text() == lines


def test_finetune_applies_overrides_to_a_recipe_object(doc):
    result = doc["result"]
    with pytest.raises(UserError, match="holds a run of a different recipe"):
        ondevice_moe.finetune(result.recipe, {"federation.rounds": 3}, output=result.run_dir)


def test_finetune_hands_the_resolved_recipe_and_folder_to_the_runner(monkeypatch, tmp_path):
    from ondevice_moe import runner

    seen = {}

    def run_recipe(recipe, output, on_method, on_round, federation, overwrite):
        seen.update(recipe=recipe, output=output, federation=federation, callbacks=(on_method, on_round),
                    overwrite=overwrite)
        return RunResult(output, {"methods": {"fedavg": {}}}, output / "report.md")

    monkeypatch.setattr(runner, "run_recipe", run_recipe)
    monkeypatch.delenv("FLWR_TELEMETRY_ENABLED", raising=False)
    on_round = print
    result = ondevice_moe.finetune(TINY, ["federation.rounds=4"], output=str(tmp_path / "run"), seed=7,
                                   device="cpu", on_round=on_round)
    assert seen["overwrite"] is False
    ondevice_moe.finetune(TINY, output=str(tmp_path / "run"), overwrite=True)
    assert seen["overwrite"] is True
    result = ondevice_moe.finetune(TINY, ["federation.rounds=4"], output=str(tmp_path / "run"), seed=7,
                                   device="cpu", on_round=on_round)
    recipe = seen["recipe"]
    assert (recipe.federation.rounds, recipe.seed, recipe.model.device) == (4, 7, "cpu")
    assert seen["output"] == tmp_path / "run" and seen["callbacks"] == (None, on_round)
    assert result.run_dir == (tmp_path / "run").resolve() and result.recipe is recipe and result.methods == ["fedavg"]
    assert os.environ["FLWR_TELEMETRY_ENABLED"] == "0"  # as the CLI sets it


def test_finetune_warns_of_an_insecure_superlink(monkeypatch, tmp_path):
    from ondevice_moe import runner

    (tmp_path / "config.toml").write_text('[superlink.lab]\naddress = "10.0.0.2:9093"\ninsecure = true\n')
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    monkeypatch.setattr(runner, "run_recipe", lambda recipe, output, *_: RunResult(tmp_path, {"methods": {}},
                                                                                          tmp_path))
    with pytest.warns(UserWarning, match="SuperLink 'lab'.*insecure"):
        ondevice_moe.finetune(TINY, federation="lab")
    with pytest.raises(UserError, match="names no SuperLink 'elsewhere'"):
        ondevice_moe.finetune(TINY, federation="elsewhere")


def test_a_recipe_is_a_file_first_then_a_bundled_name(tmp_path, monkeypatch):
    from ondevice_moe.launch import find_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("name: mine\n")
    (tmp_path / "demo").write_text("a file that shadows the bundled name\n")
    assert find_recipe(Path("demo.yaml")) == ondevice_moe.BUNDLED_RECIPES / "demo.yaml"
    assert find_recipe(Path("comigs-gpt2-agnews")) == ondevice_moe.BUNDLED_RECIPES / "comigs-gpt2-agnews.yaml"
    assert find_recipe(Path("mine.yaml")) == Path("mine.yaml")
    assert find_recipe(Path("demo")) == Path("demo"), "a file of the user's shadows a bundled name"
    assert find_recipe(Path("no-such-recipe")) == Path("no-such-recipe"), "left for the loader to report missing"
    with pytest.raises(UserError, match="is a folder"):
        find_recipe(tmp_path)

def test_load_recipe_writes_python_values_as_yaml_that_reads_back_the_same():
    recipe = ondevice_moe.load_recipe("demo.yaml", {
        "description": "yes: no # not a comment",  # a YAML-looking string stays a string
        "training.lr": 5e-4,
        "data.users.0.source": Path("bbc-news"),  # a path-like value is written as its text
        "methods": ["fedavg", {"name": "comigs", "variant": "1G1S"}],
        "data_seed": None,
    })
    assert recipe.description == "yes: no # not a comment"
    assert recipe.training.lr == 5e-4 and recipe.data.users[0].sources[0].source == "bbc-news"
    assert [m.name for m in recipe.methods] == ["fedavg", "comigs"] and recipe.data_seed is None
    assert ondevice_moe.load_recipe(recipe) is recipe  # nothing to change


def test_a_recipes_plugin_runs_only_when_trusted(tmp_path, monkeypatch):
    from ondevice_moe.methods import registry
    from ondevice_moe.methods.plugins import TRUST_ENV

    monkeypatch.delenv(TRUST_ENV, raising=False)  # and unset again after the test
    monkeypatch.setattr(registry.REGISTRY, "_files", set(registry.REGISTRY._files))
    marker = tmp_path / "ran"
    (tmp_path / "plugin.py").write_text(f"open({str(marker)!r}, 'w').write('x')\nMETHODS = {{}}\n")
    overrides = {"plugins": [str(tmp_path / "plugin.py")], "methods": ["fed-ft"]}
    digits = Path(__file__).parent / "recipes" / "tiny-digits.yaml"
    with pytest.raises(UserError, match="code would run"):
        ondevice_moe.load_recipe(digits, overrides)
    assert not marker.exists()
    with pytest.raises(UserError, match="defines no METHODS"):  # trusted: its code ran, and was read
        ondevice_moe.load_recipe(digits, overrides, trust_plugins=True)
    assert marker.exists() and os.environ[TRUST_ENV] == "1"


@pytest.mark.parametrize(("recipe", "overrides", "expected"), [
    ("no-such-recipe", None, "recipe no-such-recipe does not exist"),
    ("demo", {"federation.rounds": "many"}, "federation.rounds: Input should be a valid integer"),
    ("demo", {"federation.nonsense": 1}, "federation.nonsense: unknown key"),
    ("demo", ["federation.rounds"], "is not of the form key=value"),
    ("demo", {"federation.rounds": object()}, "is not a value a recipe can hold"),
    (42, None, "cannot read a recipe from a int"),
])
def test_a_bad_recipe_or_override_is_one_user_error(recipe, overrides, expected):
    with pytest.raises(UserError) as error:
        ondevice_moe.load_recipe(recipe, overrides)
    assert expected in error.value.problem and error.value.fix


# -- get_mixture_model ----------------------------------------------------------------------


def test_only_experts_and_routers_train_and_the_base_is_shared(tiny_model):
    mixture = get_mixture_model(tiny_model, MixtureConfig(experts=["lora", "adapter:private"], attention_lora="shared"))
    trainable = {n for n, p in mixture.named_parameters() if p.requires_grad}
    assert trainable and all(re.search(r"\.(shared|private)(_\d)?\.|\.router\.", n) for n in trainable)
    assert any(".private_0." in n for n in trainable) and any(".router." in n for n in trainable)
    base = dict(tiny_model.named_parameters())
    frozen = {n: p for n, p in mixture.named_parameters() if not p.requires_grad}
    assert all(any(p is q for q in base.values()) for p in frozen.values())  # shared with the base, not copied


def test_a_step_changes_the_output_and_leaves_the_base_alone(tiny_model, tokens):
    mixture = get_mixture_model(tiny_model, MixtureConfig(experts=["lora", "lora"], lora_rank=2), seed=3)
    with torch.no_grad():
        before, plain = mixture(tokens).logits, tiny_model(tokens).logits
    assert torch.allclose(before, plain, atol=1e-5)  # new LoRA experts add nothing
    weights = {n: p.clone() for n, p in tiny_model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in mixture.parameters() if p.requires_grad], lr=0.5)
    mixture.train()
    mixture(tokens, labels=tokens).loss.backward()
    optimizer.step()
    mixture.eval()
    with torch.no_grad():
        after = mixture(tokens).logits
    assert not torch.allclose(after, before, atol=1e-4)
    assert all(torch.equal(p, weights[n]) for n, p in tiny_model.named_parameters())


def test_the_config_builds_what_the_recipes_mixture_method_builds(tmp_path):
    from ondevice_moe.federation.device import build_model
    from ondevice_moe.federation.job import Job
    from ondevice_moe.models.registry import load_base_model
    from ondevice_moe.recipe import load_recipe

    options = {"experts": [{"kind": "lora"}, {"kind": "adapter", "role": "private"}], "router": "hermes",
               "mixing": "block", "top_k": 1, "lora_rank": 4, "adapter_rank": 8}
    recipe = load_recipe(TINY, [f"methods=[{json.dumps({'name': 'mixture', **options})}]"], seed=5)
    federated = build_model(Job(recipe, 0, tmp_path), 1).state_dict()
    config = MixtureConfig(experts=["lora", "adapter:private"], router="hermes", mixing="block", top_k=1,
                           lora_rank=4, adapter_rank=8)
    ours = get_mixture_model(load_base_model("tiny-gpt2", seed=5).model, config, seed=5, user=1).state_dict()
    assert ours.keys() == federated.keys()
    assert all(torch.equal(ours[name], federated[name]) for name in ours)


def test_the_config_takes_every_option_of_the_mixture_method_that_shapes_the_model():
    config_fields = set(MixtureConfig.__dataclass_fields__) - {"modules_to_save"}
    assert config_fields | set(_FEDERATION_ONLY) == set(method_spec("mixture").options.model_fields)
    assert not config_fields & set(_FEDERATION_ONLY)


@pytest.mark.parametrize(("options", "expected"), [
    ({"experts": ["lora"], "router": "bogus"}, "MixtureConfig: router: Input should be"),
    ({"experts": ["lorra"]}, "MixtureConfig: experts.0.kind: Input should be 'lora'"),
    ({"experts": ["lora:public"]}, "MixtureConfig: experts.0.role"),
    ({"experts": ["lora"], "lora_rank": 0}, "MixtureConfig: lora_rank: Input should be greater than or equal to 1"),
    ({"experts": ["lora", "lora"], "router": "hermes", "top_k": 3}, "MixtureConfig: top_k = 3"),
    ({"experts": "lora"}, "MixtureConfig: experts must be a list"),
    ({"experts": []}, "MixtureConfig: experts: List should have at least 1 item"),
])
def test_a_bad_config_is_one_user_error(options, expected):
    with pytest.raises(UserError) as error:
        MixtureConfig(**options)
    assert error.value.problem.startswith(expected) and error.value.fix
    assert "\n" not in error.value.problem


def test_a_model_without_expert_sites_is_refused_before_anything_is_frozen():
    net = nn.Linear(4, 4)
    with pytest.raises(UserError, match="without transformer blocks") as error:
        get_mixture_model(net, MixtureConfig(experts=["lora"]))
    assert "every-layer" in error.value.fix
    assert all(p.requires_grad for p in net.parameters())
    with pytest.raises(UserError, match=r"modules_to_save \['head'\] are not modules"):
        get_mixture_model(net, MixtureConfig(experts=["layers"], mixing="every-layer", router="none",
                                             modules_to_save=("head",)))
    with pytest.raises(UserError, match="needs a MixtureConfig"):
        get_mixture_model(net, {"experts": ["lora"]})


def test_importing_the_package_stays_light_and_exports_the_api():
    code = "import sys, ondevice_moe; print(sorted(ondevice_moe.__all__), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False"), "import ondevice_moe imported torch"
    for name in ("finetune", "get_mixture_model", "MixtureConfig", "load_adapted", "load_recipe"):
        assert f"'{name}'" in out, name
        assert callable(getattr(ondevice_moe, name)) and getattr(ondevice_moe, name).__doc__, name
    assert ondevice_moe.load_recipe is ondevice_moe.api.load_recipe
    assert (ROOT / "ondevice_moe" / "py.typed").is_file()
    with pytest.raises(AttributeError, match="no attribute 'finetuned'"):
        ondevice_moe.finetuned  # noqa: B018
