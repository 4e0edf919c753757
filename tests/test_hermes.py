"""Hermes training and aggregation rules (Hermes §4.2–4.3)."""

from pathlib import Path

import pytest
import torch

from ondevice_moe.federation.device import shared_state
from ondevice_moe.layout import ExpertSpec, Layout, RouterSpec, attach_layout
from ondevice_moe.methods import method_for
from ondevice_moe.methods.hermes.rule import inverse_frequency_weighting
from ondevice_moe.models.tiny import tiny_model
from ondevice_moe.routing.hermes import HermesRouter
from ondevice_moe.routing.lifecycle import begin_round, routed_upload
from ondevice_moe.server_rules.aggregation import Update, average, example_weighting
from ondevice_moe.training import DeviceTrainer, TrainingConfig


def hermes_routers(model: torch.nn.Module) -> list[HermesRouter]:
    return [module for module in model.modules() if isinstance(module, HermesRouter)]


def uploaded(trainer: DeviceTrainer) -> tuple[set[str], dict[str, float]]:
    """What a Hermes device sends: the names of the tensors its routers let travel, and their usage."""
    tensors, records = routed_upload(trainer.model, shared_state(trainer))
    return set(tensors), records["usage"]


@pytest.fixture
def hermes_trainer():
    torch.manual_seed(0)
    base = tiny_model("tiny-bert", 257, num_labels=2).eval().requires_grad_(False)
    method = method_for("hermes", 2, top_k=1)
    model = attach_layout(base, method.layouts[0], seed=0, own=("classifier", "bert.pooler"))
    for path in ("classifier", "bert.pooler"):
        model.get_submodule(path).requires_grad_(True)
    return DeviceTrainer(model, method, TrainingConfig(lr=1e-2, lr_schedule="constant"))


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 256, (4, 12), generator=generator),
            "attention_mask": torch.ones(4, 12, dtype=torch.long),
            "labels": torch.randint(0, 2, (4,), generator=generator)}


def _force_single_expert(trainer: DeviceTrainer, expert: str) -> None:
    """Bias every router so that all tokens pick ``expert`` (top-1)."""
    for router in hermes_routers(trainer.model):
        router.bias.fill_(-10.0)
        router.bias[router.experts.index(expert)] = 10.0
        router.bias_rate = 0.0


def test_unselected_experts_get_no_gradient_and_are_not_uploaded(hermes_trainer):
    _force_single_expert(hermes_trainer, "shared_1")  # lora, adapter, prefix = shared_0, _1, _2
    begin_round(hermes_trainer.model)
    before = {n: p.detach().clone() for n, p in hermes_trainer.model.named_parameters()}
    hermes_trainer.expert_step(_batch())
    after = dict(hermes_trainer.model.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert any(".adapters.shared_1." in n and "output.dense" in n for n in moved), "the selected adapter must train"
    assert not any("lora_" in n or ".prefix." in n for n in moved), "unselected experts must not move"
    sent, usage = uploaded(hermes_trainer)
    assert not any("lora_" in n or ".prefix." in n for n in sent)
    assert any("output.dense.adapters" in n for n in sent)
    assert any(n.startswith("classifier") for n in sent), "the task head is always uploaded"
    assert all(usage[n] == 4 * 12 for n in sent if "adapters" in n)


def test_each_block_uploads_its_top_k_experts_by_round_usage():
    base = tiny_model("tiny-bert", 257, num_labels=2).eval().requires_grad_(False)
    method = method_for("hermes", 2, top_k=2)
    trainer = DeviceTrainer(attach_layout(base, method.layouts[0], seed=0), method, TrainingConfig())
    routers = hermes_routers(trainer.model)
    for router in routers:  # lora, adapter, prefix = shared_0, _1, _2: every expert had some tokens
        router.usage.copy_(torch.tensor([5.0, 1.0, 3.0]))
    routers[0].usage.copy_(torch.tensor([1.0, 5.0, 3.0]))
    sent, _ = uploaded(trainer)
    blocks = {"layer.0.": {"shared_1", "shared_2"}, "layer.1.": {"shared_0", "shared_2"}}
    for block, expected in blocks.items():
        experts = {name for name in ("shared_0", "shared_1", "shared_2")
                   if any(block in n and f".{name}" in n for n in sent)}
        assert experts == expected, (block, experts)


def test_usage_counts_real_tokens_not_padding(hermes_trainer):
    batch = _batch()
    batch["attention_mask"][:, 9:] = 0  # right padding: 3 of 12 positions in every row
    begin_round(hermes_trainer.model)
    hermes_trainer.expert_step(batch)
    for router in hermes_routers(hermes_trainer.model):
        assert float(router.usage.sum()) == router.top_k * 4 * 9  # k experts per real token (eq. 6, 11)


def test_router_state_stays_private(hermes_trainer):
    hermes_trainer.expert_step(_batch())
    assert not any("router" in n for n in shared_state(hermes_trainer))


def test_inverse_frequency_weights_match_hand_computation():
    # Two clients used expert "e" 3 and 15 times: ω = (h + 1)^(-1/2) = 1/2 and 1/4.
    updates = [Update(0, {"e": torch.tensor([1.0]), "head": torch.tensor([1.0])}, 10, {"usage": {"e": 3.0}}),
               Update(1, {"e": torch.tensor([4.0]), "head": torch.tensor([4.0])}, 30, {"usage": {"e": 15.0}})]
    weighting = inverse_frequency_weighting(0.5, 1.0, example_weighting("num_examples"))
    result = average(updates, weighting)
    expected_expert = (0.5 * 1.0 + 0.25 * 4.0) / (0.5 + 0.25)
    expected_head = (10 * 1.0 + 30 * 4.0) / 40  # heads follow FedAvg
    torch.testing.assert_close(result["e"], torch.tensor([expected_expert]))
    torch.testing.assert_close(result["head"], torch.tensor([expected_head]))


def test_gradient_view_follows_training(hermes_trainer):
    routers = hermes_routers(hermes_trainer.model)
    initial = [r.gradient_score.clone() for r in routers]
    hermes_trainer.expert_step(_batch())
    assert any(not torch.equal(a, r.gradient_score) for a, r in zip(initial, routers, strict=True))
    for router in routers:
        torch.testing.assert_close(router.gradient_score.sum(), torch.tensor(1.0))


def test_prefix_on_an_unsupported_model_is_refused():
    from transformers import XLNetConfig, XLNetForSequenceClassification

    from ondevice_moe.errors import UserError

    model = XLNetForSequenceClassification(XLNetConfig(d_model=32, n_layer=1, n_head=2, d_inner=64, vocab_size=50))
    with pytest.raises(UserError, match=r"expert sites|attention"):
        attach_layout(model, Layout(experts=(ExpertSpec("prefix", "shared"),), router=RouterSpec("none"),
                                    mixing="block"), seed=0)


def test_bundled_classification_recipes_hold_hermes_and_every_baseline():
    from ondevice_moe.recipe import load_recipe

    recipe = load_recipe(Path(__file__).parent.parent / "recipes" / "hermes-minilm-rotten-tomatoes.yaml")
    names = {recipe.method_name(index) for index in range(len(recipe.methods))}
    assert {"hermes", "fed-ft", "fed-lora", "fed-adapter", "fed-prefix", "fed-unipelt"} <= names
    assert {"hermes-w/o-A", "hermes-w/o-K", "hermes-w/o-G", "hermes-w/o-F"} <= names


def test_the_upload_reference_holds_every_expert_a_client_may_send():
    """Round 1's check of a Hermes update must know experts no token chose yet."""
    from ondevice_moe.federation.device import upload_reference
    from ondevice_moe.federation.job import Job
    from ondevice_moe.recipe import load_recipe

    job = Job(load_recipe(Path(__file__).parent / "recipes" / "tiny-classification.yaml"), 0, Path("."))
    reference = upload_reference(job, 0)
    assert job.method.name == "hermes"
    for kind in ("lora_A", "adapters.shared_1.up", "prefix.shared_2.key", "classifier.weight"):
        assert any(kind in name for name in reference), kind
    assert not any("router" in name for name in reference)
    assert all(tensor.device.type == "meta" for tensor in reference.values())


def test_without_aggregation_balance_averages_each_expert_uniformly_over_its_uploaders():
    """Table 2's w/o-A is §4.3's "naive choice ω = 1": FedAvg of an expert over the devices that sent it,
    whatever their example counts; task heads keep the federation's weighting."""
    from ondevice_moe.methods.base import MethodContext
    from ondevice_moe.methods.registry import build_method, method_options

    method = build_method("hermes", method_options("hermes", {"ablation": "w/o-A"}),
                          MethodContext(3, weighting="num_examples"))
    updates = [Update(0, {"e": torch.tensor([1.0]), "head": torch.tensor([1.0])}, 10, {"usage": {"e": 3.0}}),
               Update(1, {"e": torch.tensor([4.0]), "head": torch.tensor([4.0])}, 30, {"usage": {"e": 15.0}}),
               Update(2, {"head": torch.tensor([8.0])}, 60, {})]
    result = average(updates, method.server_rule.weights())
    torch.testing.assert_close(result["e"], torch.tensor([2.5]))  # (1 + 4) / 2, not (10·1 + 30·4) / 40
    torch.testing.assert_close(result["head"], torch.tensor([(10 * 1.0 + 30 * 4.0 + 60 * 8.0) / 100]))
