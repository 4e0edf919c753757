import pytest
import torch

from ondevice_moe.errors import UserError
from ondevice_moe.layout import attach_layout
from ondevice_moe.methods import Role, method_for
from ondevice_moe.server_rules.aggregation import Update, average, check_update, example_weighting
from ondevice_moe.training import DeviceTrainer, TrainingConfig


def _shared_names(tiny_model, name, **options):
    from ondevice_moe.federation.device import shared_state

    method = method_for(name, 2, **options)
    model = attach_layout(tiny_model, method.layouts[0], seed=0)
    return set(shared_state(DeviceTrainer(model, method, TrainingConfig())))


def test_comigs_shares_generalists_and_attention_only(tiny_model):
    names = _shared_names(tiny_model, "comigs", variant="1G1S")
    assert any(".shared_0." in n for n in names)
    assert any(".adapters.shared." in n for n in names)
    assert not any("private" in n or "router" in n for n in names)


def test_pfedmoe_shares_like_1g1s_but_trains_its_router_jointly(tiny_model):
    assert _shared_names(tiny_model, "pfedmoe") == _shared_names(tiny_model, "comigs", variant="1G1S")
    assert method_for("pfedmoe", 2).procedure.routers == "joint"
    assert method_for("comigs", 2).procedure.routers == "bilevel"


def test_local_shares_nothing(tiny_model):
    assert _shared_names(tiny_model, "local") == set()


def test_ffa_lora_sends_b_only_and_fedsa_lora_sends_a_only(tiny_model):
    ffa = _shared_names(tiny_model, "ffa-lora")
    fedsa = _shared_names(tiny_model, "fedsa-lora")
    assert ffa and all(n.endswith("lora_B") for n in ffa)
    assert fedsa and all(n.endswith("lora_A") for n in fedsa)


def test_fedavg_moe_keeps_routers_local_unless_asked(tiny_model):
    default = _shared_names(tiny_model, "fedavg-moe")
    assert any(".experts." in n for n in default) and not any(".router." in n for n in default)
    assert method_for("fedavg-moe", 2, share_router=True).name == "fedavg-moe-shared-router"
    assert any(".router." in n for n in _shared_names(tiny_model, "fedavg-moe", share_router=True))


def test_comigs_2s_shares_nothing_and_2g_everything_but_routers(tiny_model):
    assert _shared_names(tiny_model, "comigs", variant="2S") == set()
    shared_2g = _shared_names(tiny_model, "comigs", variant="2G")
    model = attach_layout(tiny_model, method_for("comigs", 2, variant="2G").layouts[0], seed=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert shared_2g == {n for n in trainable if ".router." not in n}


def test_comigs_halves_upload_against_fedavg(tiny_model):
    fedavg = _shared_names(tiny_model, "fedavg-two-lora")  # the paper's FedAvg, two modules per MLP
    comigs = _shared_names(tiny_model, "comigs")
    mlp = [n for n in fedavg if ".experts." in n]
    assert len([n for n in comigs if ".experts." in n]) * 2 == len(mlp)


def test_1gxs_layouts_follow_expert_counts():
    method = method_for("comigs", 3, variant="1GXs", experts=[1, 3, 2])
    assert [layout.expert_names for layout in method.layouts] == [
        ["shared_0"], ["shared_0", "private_0", "private_1"], ["shared_0", "private_0"]]


def test_1gxs_needs_one_count_per_user():
    with pytest.raises(UserError, match="one count"):
        method_for("comigs", 3, variant="1GXs", experts=[2, 2])


def test_roles_from_names():
    method = method_for("comigs", 2)
    assert method.role_of("model.layers.0.mlp.experts.shared_0.up_proj.lora_A") is Role.SHARED
    assert method.role_of("model.layers.0.mlp.experts.private_0.up_proj.lora_A") is Role.PRIVATE
    assert method.role_of("model.layers.0.mlp.router.gate.weight") is Role.PRIVATE


def test_average_is_the_mean_over_holders():
    updates = [
        Update(0, {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([4.0])}, 10),
        Update(1, {"a": torch.tensor([3.0, 6.0])}, 30),
    ]
    uniform = average(updates)
    torch.testing.assert_close(uniform["a"], torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(uniform["b"], torch.tensor([4.0]))
    weighted = average(updates, example_weighting("num_examples"))
    torch.testing.assert_close(weighted["a"], torch.tensor([2.5, 5.0]))


def test_misbehaving_updates_are_named():
    reference = {"a": torch.zeros(2)}
    assert check_update(Update(0, {"a": torch.tensor([1.0, 2.0])}, 5), reference) is None
    assert "non-finite" in check_update(Update(1, {"a": torch.tensor([float("nan"), 0.0])}, 5), reference)
    assert "shape" in check_update(Update(2, {"a": torch.zeros(3)}, 5), reference)
    assert "unexpected" in check_update(Update(3, {"c": torch.zeros(2)}, 5), reference)
    assert "examples" in check_update(Update(4, {"a": torch.zeros(2)}, 0), reference)


def test_unavailable_hub_model_says_what_is_missing():
    from ondevice_moe.models import load_base_model

    with pytest.raises(UserError, match="cannot load model 'someone/not-cached-model'") as raised:
        load_base_model("someone/not-cached-model")
    assert "smollm2-135m" in raised.value.fix


def _recipe_with_methods(methods):
    from pathlib import Path

    import yaml

    from ondevice_moe.recipe import validate_recipe

    raw = yaml.safe_load((Path(__file__).parent / "recipes" / "tiny.yaml").read_text())
    raw["methods"] = methods
    return validate_recipe(raw)


def test_an_option_the_method_does_not_take_is_rejected_with_its_valid_options():
    with pytest.raises(UserError, match="'router_data' is not an option of method 'local-moe'") as raised:
        _recipe_with_methods([{"name": "local-moe", "router_data": "train"}])
    assert "lora_rank" in raised.value.problem and "label" in raised.value.problem
    with pytest.raises(UserError, match="'ablation' is not an option of method 'comigs'"):
        _recipe_with_methods([{"name": "comigs", "ablation": "w/o-A"}])


def test_a_wrong_option_value_names_the_option():
    with pytest.raises(UserError, match="variant"):
        _recipe_with_methods([{"name": "comigs", "variant": "3G"}])


def test_two_entries_with_one_name_are_refused_until_labelled():
    with pytest.raises(UserError, match=r"same name \['fedavg'\].*label"):
        _recipe_with_methods(["fedavg", "fedavg"])
    with pytest.raises(UserError, match="same name"):
        _recipe_with_methods([{"name": "comigs", "variant": "1GXs", "experts": [2, 2, 2]},
                              {"name": "comigs", "variant": "1GXs", "experts": [2, 3, 2]}])
    recipe = _recipe_with_methods(["fedavg", {"name": "fedavg", "label": "fedavg-again"}])
    assert [recipe.method_name(i) for i in range(2)] == ["fedavg", "fedavg-again"]


def test_family_sections_give_defaults_and_entries_override_them():
    recipe = _recipe_with_methods(["comigs", {"name": "comigs", "label": "r4", "lora_rank": 4}])
    assert recipe.method_options(0).lora_rank == recipe.experts.lora_rank == 8
    assert recipe.method_options(1).lora_rank == 4


def test_comigs_with_an_adapter_generalist_holds_an_adapter_and_shares_it(tiny_model):
    method = method_for("comigs", 2, generalist="adapter")
    assert method.name == "comigs-1G1S-adapterG-loraS"
    names = _shared_names(tiny_model, "comigs", generalist="adapter")
    assert any(".experts.shared_0.down" in n for n in names)
    assert not any("private" in n for n in names)


def test_hermes_trains_on_a_causal_language_model(tiny_model, tokens):
    """Hermes's LLaMA columns: the same experts and router on a decoder, trained on next-token loss."""
    from ondevice_moe.federation.device import shared_state
    from ondevice_moe.routing.lifecycle import begin_round, routed_upload

    method = method_for("hermes", 2)
    model = attach_layout(tiny_model, method.layouts[0], seed=0)
    trainer = DeviceTrainer(model, method, TrainingConfig(lr=1e-2, lr_schedule="constant"))
    begin_round(model)
    losses = [trainer.expert_step({"input_ids": tokens, "labels": tokens}) for _ in range(4)]
    assert losses[-1] < losses[0]
    tensors, records = routed_upload(model, shared_state(trainer))
    usage = records["usage"]
    assert usage and max(usage.values()) > 0
    uploaded = set(tensors)
    assert uploaded and not any("router" in n for n in uploaded)


def test_full_fine_tuning_on_a_quantized_base_is_refused():
    from pathlib import Path

    import yaml

    from ondevice_moe.recipe import validate_recipe

    raw = yaml.safe_load((Path(__file__).parent / "recipes" / "tiny-classification.yaml").read_text())
    raw["model"]["quantization"] = "nf4"
    raw["methods"] = ["fed-lora", "fed-ft"]
    with pytest.raises(UserError, match=r"\['fed-ft'\] train every base weight"):
        validate_recipe(raw)
    raw["methods"] = ["fed-lora"]
    assert validate_recipe(raw).model.quantization == "nf4"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_full_fine_tuning_on_a_half_precision_base_is_refused_with_the_way_out(dtype):
    # An AdamW step below half a bfloat16 weight's spacing rounds away: at lr 5e-5 about a third of
    # 24 steps' movement survives, so FedFT would look worse than it is rather than fail.
    from pathlib import Path

    import yaml

    from ondevice_moe.recipe import validate_recipe

    raw = yaml.safe_load((Path(__file__).parent / "recipes" / "tiny-classification.yaml").read_text())
    raw["model"]["dtype"] = dtype
    raw["methods"] = ["fed-lora", "fed-ft"]
    with pytest.raises(UserError, match=rf"\['fed-ft'\] train every base weight, which a {dtype} base.*"
                                        r"model\.dtype: float32"):
        validate_recipe(raw)
    raw["methods"] = ["fed-lora"]
    assert validate_recipe(raw).model.dtype == dtype
