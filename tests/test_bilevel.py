"""CoMiGS Alg. 1: experts move on training batches, routers on validation batches only."""

from pathlib import Path

import pytest
import torch
from conftest import VOCAB

from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.layout import attach_layout
from ondevice_moe.methods import method_for
from ondevice_moe.recipe import load_recipe
from ondevice_moe.training import DeviceTrainer, TrainingConfig


def _trainer(tiny_model, name="comigs", **options) -> DeviceTrainer:
    method = method_for(name, 2, **options)
    model = attach_layout(tiny_model, method.layouts[0], seed=0)
    config = TrainingConfig(router_period=3, router_steps=2, batch_size=2, total_iterations=20, lr=1e-2,
                            router_lr=1e-2)
    return DeviceTrainer(model, method, config)


def _snapshot(trainer: DeviceTrainer) -> dict[str, dict[str, torch.Tensor]]:
    named = dict(trainer.model.named_parameters())
    groups = {"router": {}, "expert": {}}
    for name, param in named.items():
        if ".router." in name:
            groups["router"][name] = param.detach().clone()
        elif name.endswith(("lora_A", "lora_B")):
            groups["expert"][name] = param.detach().clone()
    return groups


def _moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(before[n], after[n]) for n in before)


class RecordingSampler:
    """Returns a distinct random batch per index and remembers which split was asked."""

    def __init__(self, split: str, log: list[str]):
        self.split, self.log = split, log

    def __call__(self, index: int) -> dict[str, torch.Tensor]:
        self.log.append(self.split)
        tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens}


def test_router_moves_only_on_router_steps_on_validation_batches(tiny_model):
    trainer = _trainer(tiny_model)
    log: list[str] = []
    train, valid = RecordingSampler("train", log), RecordingSampler("valid", log)

    before = _snapshot(trainer)
    trainer.train_iterations(2, train, valid)  # iterations 1-2: no router phase yet (τ = 3)
    middle = _snapshot(trainer)
    assert log == ["train", "train"]
    assert _moved(before["expert"], middle["expert"])
    assert not _moved(before["router"], middle["router"]), "router moved on an expert step"

    trainer.train_iterations(1, train, valid)  # iteration 3: expert step, then s = 2 router steps
    after = _snapshot(trainer)
    assert log == ["train", "train", "train", "valid", "valid"]
    assert _moved(middle["router"], after["router"])


def test_experts_never_move_on_router_steps(tiny_model):
    trainer = _trainer(tiny_model)
    # Fresh experts are identical (B = 0), so the router would get no gradient yet.
    for index in range(2):
        trainer.expert_step(RecordingSampler("train", [])(index))
    before = _snapshot(trainer)
    trainer.router_step(RecordingSampler("valid", [])(99))
    after = _snapshot(trainer)
    assert _moved(before["router"], after["router"])
    assert not _moved(before["expert"], after["expert"])


def test_train_split_ablation_samples_router_batches_from_training_data(tiny_model):
    method = method_for("comigs", 2, router_data="train")
    assert method.procedure.router_data == "train" and method.name == "comigs-1G1S-tr"


def test_joint_router_moves_with_experts(tiny_model):
    trainer = _trainer(tiny_model, name="local-moe")
    before = _snapshot(trainer)
    log: list[str] = []
    trainer.train_iterations(3, RecordingSampler("train", log), RecordingSampler("valid", log))
    after = _snapshot(trainer)
    assert log == ["train"] * 3, "joint routing must never read the validation split"
    assert _moved(before["router"], after["router"])


def test_frozen_lora_a_never_moves_in_ffa_lora(tiny_model):
    trainer = _trainer(tiny_model, name="ffa-lora")
    params = dict(trainer.model.named_parameters())
    a_before = {n: p.detach().clone() for n, p in params.items() if n.endswith("lora_A")}
    b_before = {n: p.detach().clone() for n, p in params.items() if n.endswith("lora_B")}
    trainer.train_iterations(2, RecordingSampler("train", []), RecordingSampler("valid", []))
    assert all(torch.equal(a_before[n], params[n]) for n in a_before)
    assert any(not torch.equal(b_before[n], params[n]) for n in b_before)


def test_optimizer_state_round_trips(tiny_model):
    trainer = _trainer(tiny_model)
    trainer.train_iterations(3, RecordingSampler("train", []), RecordingSampler("valid", []))
    state = trainer.optimizer_state()
    fresh = _trainer(tiny_model)
    fresh.load_optimizer_state(state)
    assert fresh.iteration == 3
    assert fresh.scheduler.last_epoch == trainer.scheduler.last_epoch == 3


@pytest.mark.parametrize("router_validation", ["own", "union"])
def test_routers_learn_on_the_target_distribution(tmp_path, router_validation):
    recipe = load_recipe(Path(__file__).parent / "recipes" / "tiny.yaml",
                         [f"data.router_validation={router_validation}"])
    job = Job(recipe, method_index=2, run_dir=tmp_path)
    assert job.method.name == "comigs-1G1S"
    valid = [dev.user_data(job, user).valid for user in range(len(recipe.data.users))]
    expected = torch.cat(valid) if router_validation == "union" else valid[1]
    assert torch.equal(dev.router_blocks(job, 1).blocks, expected)


def test_cosine_schedule_follows_the_authors_cosine_annealing_to_a_tenth(tiny_model):
    trainer = _trainer(tiny_model)
    trainer = DeviceTrainer(trainer.model, trainer.method,
                            TrainingConfig(lr=2e-3, total_iterations=12, lr_schedule="cosine"))
    reference_optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(reference_optimizer, T_max=12, eta_min=2e-4)
    for _ in range(12):
        assert trainer.scheduler.get_last_lr()[0] == pytest.approx(reference.get_last_lr()[0])
        trainer.expert_optimizer.step()
        trainer.scheduler.step()
        reference_optimizer.step()
        reference.step()
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(2e-4)


def test_recipe_optimiser_settings_reach_both_optimisers(tiny_model, tmp_path):
    recipe = load_recipe(Path(__file__).parent / "recipes" / "tiny.yaml",
                         ["training.betas=[0.9, 0.95]", "training.weight_decay=0.01",
                          "training.router_weight_decay=0.02"])
    trainer = DeviceTrainer(_trainer(tiny_model).model, method_for("comigs", 2),
                            Job(recipe, method_index=2, run_dir=tmp_path).training)
    experts, routers = trainer.expert_optimizer.param_groups[0], trainer.router_optimizer.param_groups[0]
    assert experts["betas"] == routers["betas"] == (0.9, 0.95)
    assert (experts["weight_decay"], routers["weight_decay"]) == (0.01, 0.02)


def test_betas_outside_the_unit_interval_are_refused():
    from ondevice_moe.errors import UserError

    with pytest.raises(UserError, match="betas"):
        load_recipe(Path(__file__).parent / "recipes" / "tiny.yaml", ["training.betas=[0.9, 1.5]"])


@pytest.mark.parametrize("name", ["local-moe", "fedavg-moe"])
def test_tr_ablation_alternates_router_steps_on_training_batches(name):
    joint, alternating = method_for(name, 2), method_for(name, 2, alternate_on_train=True)
    assert joint.procedure.routers == "joint"
    assert (alternating.name, alternating.procedure.routers, alternating.procedure.router_data) == (
        f"{name}-tr", "bilevel", "train")


def test_nll_standard_error_is_the_spread_of_block_means_over_root_n():
    from ondevice_moe.likelihood import nll_standard_error

    per_token = torch.tensor([2.0, 2.2, 1.8, 2.4], dtype=torch.float64)
    summed = per_token * 31  # blocks of 32 tokens: 31 predicted tokens each
    assert nll_standard_error(summed, 32) == pytest.approx(float(per_token.std()) / 2)
    assert nll_standard_error(summed[:1], 32) is None
