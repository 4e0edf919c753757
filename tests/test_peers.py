"""PCL: the server relays peers' models, each device weighs them by validation perplexity."""

import json
import math
from pathlib import Path

import pytest
import torch

from ondevice_moe import runner
from ondevice_moe.federation.aggregation import Update
from ondevice_moe.federation.peers import PeerRelayRule, mix_peers, peer_key, split_peers, trust_weights
from ondevice_moe.layout import attach_layout
from ondevice_moe.methods import method_for
from ondevice_moe.recipe import load_recipe
from ondevice_moe.training import DeviceTrainer, TrainingConfig, block_nll, perplexity_of, trainable_state

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

    from ondevice_moe.federation.device import PRIVATE_KEY, save_private_state, shared_state

    method = method_for("pcl", 2)
    trainer = DeviceTrainer(attach_layout(tiny_model, method.layouts[0], seed=0), method, TrainingConfig())
    state = RecordDict()
    save_private_state(trainer, state)
    kept = set(state[PRIVATE_KEY].to_torch_state_dict())
    assert kept and set(shared_state(trainer)) <= kept


def test_pcl_runs_through_flower_and_mixes_on_its_rounds(tmp_path):
    recipe = load_recipe(TINY, ["methods=[pretrained, {name: pcl, first_mix: 2, every: 1}]"])
    result = runner.run_recipe(recipe, tmp_path / "pcl")
    methods = result.summary["methods"]
    assert methods["pcl"]["mean_in"] < methods["pretrained"]["mean_in"]
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["method"] == "pcl" and r["kind"] == "train"]
    mixed = [r for r in train if r["round"] == 2]
    assert len(mixed) == 3 and not any("trust_0" in r for r in train if r["round"] == 1)
    for record in mixed:
        assert math.isclose(sum(record[f"trust_{j}"] for j in range(3)), 1.0, rel_tol=1e-5)
    comm = {r["round"]: r for r in records if r["method"] == "pcl" and r["kind"] == "comm"}
    # Round 2 starts with a mix: each of the 3 devices is sent all 3 models of round 1.
    assert comm[1]["bytes_down"] == 0 and comm[2]["bytes_down"] == 3 * comm[1]["bytes_up"] > 0
