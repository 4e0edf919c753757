"""The client-level baselines of CoMiGS Table 2: PCL (the server relays peers' models, each
device weighs them by validation perplexity) and FDLoRA (global and personal modules trained
in turn, weighed once per device before testing)."""

import json
import math
from pathlib import Path

import pytest
import torch

from ondevice_moe import runner
from ondevice_moe.layout import attach_layout
from ondevice_moe.likelihood import block_nll, perplexity_of
from ondevice_moe.methods import method_for
from ondevice_moe.recipe import load_recipe
from ondevice_moe.routing.fusion import FUSION_GRID, fit_fusion, set_fusion
from ondevice_moe.server_rules.aggregation import Update
from ondevice_moe.server_rules.peers import PeerRelayRule, mix_peers, peer_key, split_peers, trust_weights
from ondevice_moe.training import DeviceTrainer, TrainingConfig, trainable_state

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
NAME = "h.0.mlp.experts.shared_0.c_fc.lora_B"


def _update(device: int, value: float) -> Update:
    return Update(device, {NAME: torch.full((3, 2), value)}, num_examples=10)


def test_relay_sends_every_peer_on_mixing_rounds_and_nothing_otherwise():
    rule = PeerRelayRule(first_mix=6, every=2)
    slots = rule.aggregate(rule.initial_slots(), [_update(0, 1.0), _update(1, 2.0)])
    assert [r for r in range(1, 12) if rule.mixes(r)] == [6, 8, 10]
    assert rule.message_for(slots, 0, train_round=5) == {}
    assert rule.message_for(slots, 0, train_round=None) == {}  # evaluation: the device's own model
    message = rule.message_for(slots, 1, train_round=8)
    assert set(message) == {peer_key(0, NAME), peer_key(1, NAME)}
    torch.testing.assert_close(split_peers(message)[1][NAME], torch.full((3, 2), 2.0))


def test_a_device_left_out_of_a_round_keeps_its_older_model_on_the_server():
    rule = PeerRelayRule()
    slots = rule.aggregate(rule.initial_slots(), [_update(0, 1.0), _update(1, 2.0)])
    slots = rule.aggregate(slots, [_update(1, 5.0)])
    torch.testing.assert_close(rule.reference(slots, 0)[NAME], torch.full((3, 2), 1.0))
    torch.testing.assert_close(rule.reference(slots, 1)[NAME], torch.full((3, 2), 5.0))


def test_trust_is_the_softmax_of_negative_perplexity():
    weights = trust_weights(torch.tensor([10.0, 11.0, 13.0]))
    expected = [math.exp(-p) for p in (10.0, 11.0, 13.0)]
    torch.testing.assert_close(weights, torch.tensor([e / sum(expected) for e in expected]))


@pytest.mark.parametrize("tiny_model", ["gpt2"], indirect=True)
def test_mixing_weights_the_better_peer_up_and_loads_the_weighted_average(tiny_model):
    method = method_for("pcl", 2)
    model = attach_layout(tiny_model, method.layouts[0], seed=0)
    blocks = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    own = {name: t.clone() for name, t in trainable_state(model).items()}
    noisy = {name: t + 0.5 * torch.randn(t.shape, generator=torch.Generator().manual_seed(2))
             for name, t in own.items()}
    weights = mix_peers(model, {0: own, 1: noisy}, blocks, batch_size=2)
    assert weights[0] > weights[1] and math.isclose(weights[0] + weights[1], 1.0, rel_tol=1e-6)
    mixed = trainable_state(model)
    for name in own:
        torch.testing.assert_close(mixed[name], weights[0] * own[name] + weights[1] * noisy[name])
    assert model.training  # back to training after the validation passes
    model.load_state_dict(own, strict=False)
    assert perplexity_of(block_nll(model, blocks, 2), 16) < math.inf


@pytest.mark.parametrize("tiny_model", ["gpt2"], indirect=True)
def test_a_pcl_device_keeps_its_shared_modules_between_rounds(tiny_model):
    from flwr.app import RecordDict

    from ondevice_moe.federation.device import save_private_state, shared_state
    from ondevice_moe.federation.device_state import private_tensors
    from ondevice_moe.federation.job import Job

    method = method_for("pcl", 2)
    trainer = DeviceTrainer(attach_layout(tiny_model, method.layouts[0], seed=0), method, TrainingConfig())
    state = RecordDict()
    save_private_state(Job(load_recipe(TINY, ["methods=[pcl]"]), 0, Path(".")), 0, trainer, state, 1)
    kept = set(private_tensors(state))
    assert kept and set(shared_state(trainer)) <= kept


@pytest.fixture(scope="module")
def client_level_run(tmp_path_factory):
    recipe = load_recipe(TINY, ["methods=[pretrained, {name: pcl, first_mix: 2, every: 1}, fdlora]"])
    result = runner.run_recipe(recipe, tmp_path_factory.mktemp("run") / "client-level")
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return result.summary["methods"], records


def test_pcl_runs_through_flower_and_mixes_on_its_rounds(client_level_run):
    methods, records = client_level_run
    assert methods["pcl"]["mean_in"] < methods["pretrained"]["mean_in"]
    train = [r for r in records if r["method"] == "pcl" and r["kind"] == "train"]
    mixed = [r for r in train if r["round"] == 2]
    assert len(mixed) == 3 and not any("trust_0" in r for r in train if r["round"] == 1)
    for record in mixed:
        assert math.isclose(sum(record[f"trust_{j}"] for j in range(3)), 1.0, rel_tol=1e-5)
    comm = {r["round"]: r for r in records if r["method"] == "pcl" and r["kind"] == "comm"}
    # Round 2 starts with a mix: each of the 3 devices is sent all 3 models of round 1.
    assert comm[1]["bytes_down"] == 0 and comm[2]["bytes_down"] == 3 * comm[1]["bytes_up"] > 0


@pytest.mark.parametrize("tiny_model", ["gpt2"], indirect=True)
def test_fdlora_trains_the_global_and_the_personal_module_in_turn(tiny_model):
    method = method_for("fdlora", 2)
    trainer = DeviceTrainer(attach_layout(tiny_model, method.layouts[0], seed=0), method, TrainingConfig())
    batch = {"input_ids": torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"]

    def snapshot(part: str) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in trainable_state(trainer.model).items() if part in n}

    for turn_trained, turn_idle in (("private_0", "shared_0"), ("shared_0", "private_0")):
        before_trained, before_idle, before_attention = snapshot(turn_trained), snapshot(turn_idle), snapshot("attn")
        trainer.train_iterations(1, lambda _: batch, lambda _: batch)  # iteration 1 is the personal module's
        assert all(torch.equal(t, snapshot(turn_idle)[n]) for n, t in before_idle.items())
        assert any(not torch.equal(t, snapshot(turn_trained)[n]) for n, t in before_trained.items())
        assert any(not torch.equal(t, snapshot("attn")[n]) for n, t in before_attention.items())


@pytest.mark.parametrize("tiny_model", ["gpt2"], indirect=True)
def test_fusion_picks_the_grid_weight_with_the_lowest_validation_nll(tiny_model):
    method = method_for("fdlora", 2)
    model = attach_layout(tiny_model, method.layouts[0], seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "shared_0" in name and name.endswith("lora_B"):
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    blocks = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for weight in FUSION_GRID:
        set_fusion(model, weight)
        losses.append(float(block_nll(model, blocks, 2).sum()))
    chosen = fit_fusion(model, blocks, batch_size=2)
    assert chosen == FUSION_GRID[losses.index(min(losses))]
    assert len(set(losses)) > 1  # the global module's noise matters, so the choice is a real one


def test_fdlora_runs_through_flower_keeps_the_personal_module_home_and_reports_its_fusion(client_level_run):
    methods, records = client_level_run
    assert methods["fdlora"]["mean_in"] < methods["pretrained"]["mean_in"]
    final = [r for r in records if r["method"] == "fdlora" and r["kind"] == "eval" and r["round"] == 2]
    assert len(final) == 3 and all(r["fusion_global"] in FUSION_GRID for r in final)
    pcl_up = methods["pcl"]["upload_bytes_per_round"]
    assert 0 < methods["fdlora"]["upload_bytes_per_round"] < pcl_up  # the personal module stays home
