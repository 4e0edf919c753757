import pytest
import torch

from ondevice_moe.errors import UserError
from ondevice_moe.federation.aggregation import Update, average, check_update, example_weighting
from ondevice_moe.layout import attach_layout
from ondevice_moe.methods import Role, method_for
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


def test_local_shares_nothing(tiny_model):
    assert _shared_names(tiny_model, "local") == set()


def test_ffa_lora_sends_b_only_and_fedsa_lora_sends_a_only(tiny_model):
    ffa = _shared_names(tiny_model, "ffa-lora")
    fedsa = _shared_names(tiny_model, "fedsa-lora")
    assert ffa and all(n.endswith("lora_B") for n in ffa)
    assert fedsa and all(n.endswith("lora_A") for n in fedsa)


def test_fedavg_moe_shares_the_router(tiny_model):
    assert any(".router." in n for n in _shared_names(tiny_model, "fedavg-moe"))


def test_comigs_halves_upload_against_fedavg(tiny_model):
    fedavg = _shared_names(tiny_model, "fedavg")
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
