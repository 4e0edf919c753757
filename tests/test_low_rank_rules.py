"""HetLoRA and FlexLoRA: devices with different LoRA ranks (CoMiGS Table 1 baselines)."""

import math

import pytest
import torch

from ondevice_moe.errors import UserError
from ondevice_moe.layout import attach_layout
from ondevice_moe.methods import method_for
from ondevice_moe.server_rules.aggregation import Update
from ondevice_moe.server_rules.low_rank_rules import FlexLoRARule, HetLoRARule
from ondevice_moe.server_rules.rules import GLOBAL

MODULE = "h.0.mlp.experts.shared_0.c_fc"
ATTENTION = "h.0.attn.c_attn.adapters.shared.lora_A"


def _update(device: int, rank: int, seed: int, examples: int = 1) -> Update:
    generator = torch.Generator().manual_seed(seed)
    tensors = {f"{MODULE}.lora_A": torch.randn(rank, 6, generator=generator),
               f"{MODULE}.lora_B": torch.randn(5, rank, generator=generator),
               ATTENTION: torch.randn(2, 6, generator=generator)}
    return Update(device, tensors, examples)


def test_hetlora_zero_pads_weights_by_frobenius_norm_and_truncates_per_device():
    rule = HetLoRARule(ranks=(2, 4))
    small, large = _update(0, 2, seed=0), _update(1, 4, seed=1)
    slots = rule.aggregate(rule.initial_slots(), [small, large])
    name = f"{MODULE}.lora_A"
    norms = [float(torch.linalg.matrix_norm(u.tensors[name])) for u in (small, large)]
    weights = [n / sum(norms) for n in norms]
    expected = weights[1] * large.tensors[name]
    expected[:2] += weights[0] * small.tensors[name]
    torch.testing.assert_close(slots[GLOBAL][name], expected)
    torch.testing.assert_close(slots[GLOBAL][ATTENTION], (small.tensors[ATTENTION] + large.tensors[ATTENTION]) / 2)
    message = rule.message_for(slots, 0)
    assert message[name].shape == (2, 6) and message[f"{MODULE}.lora_B"].shape == (5, 2)
    torch.testing.assert_close(message[name], expected[:2])
    assert rule.message_for(slots, 1)[name].shape == (4, 6)


def test_flexlora_sends_each_device_the_best_approximation_at_its_rank():
    rule = FlexLoRARule(ranks=(2, 4), lora_alpha=16.0)
    updates = [_update(0, 2, seed=0, examples=3), _update(1, 4, seed=1, examples=1)]
    slots = rule.aggregate(rule.initial_slots(), updates)
    delta = sum(u.num_examples * rule.scaling(u.tensors[f"{MODULE}.lora_A"].shape[0])
                * u.tensors[f"{MODULE}.lora_B"] @ u.tensors[f"{MODULE}.lora_A"] for u in updates) / 4
    u, s, vt = torch.linalg.svd(delta, full_matrices=False)
    for device, rank in enumerate(rule.ranks):
        message = rule.message_for(slots, device)
        down, up = message[f"{MODULE}.lora_A"], message[f"{MODULE}.lora_B"]
        assert down.shape == (rank, 6) and up.shape == (5, rank)
        best = (u[:, :rank] * s[:rank]) @ vt[:rank]
        torch.testing.assert_close(rule.scaling(rank) * up @ down, best, rtol=1e-5, atol=1e-5)
        assert rule.reference(slots, device)[f"{MODULE}.lora_B"].shape == (5, rank)
    assert rule.scaling(4) == pytest.approx(16.0 / math.sqrt(4))


def test_each_device_holds_its_own_rank(tiny_model):
    method = method_for("hetlora", 2, ranks=[4, 8])
    for layout, rank in zip(method.layouts, (4, 8), strict=True):
        model = attach_layout(tiny_model, layout, seed=0)
        ranks = {p.shape[0] for n, p in model.named_parameters() if ".experts." in n and n.endswith("lora_A")}
        attention = {p.shape[0] for n, p in model.named_parameters() if ".adapters." in n and n.endswith("lora_A")}
        assert ranks == {rank} and attention == {8}


@pytest.mark.parametrize("name", ["hetlora", "flexlora"])
def test_ranks_must_name_one_per_user(name):
    with pytest.raises(UserError, match="one MLP LoRA rank"):
        method_for(name, 3, ranks=[16, 16])


def test_hetlora_prunes_a_device_whose_last_ranks_weigh_less_than_the_servers():
    rule = HetLoRARule(ranks=(4, 4), pruning_strength=0.75)
    slots = rule.aggregate(rule.initial_slots(), [_update(0, 4, seed=0), _update(1, 4, seed=1)])
    assert rule.kept_rank(slots, 0, f"{MODULE}.lora_A") == 4  # nothing on the server yet to compare with
    faded, loud = _update(0, 4, seed=2), _update(1, 4, seed=3)
    faded.tensors[f"{MODULE}.lora_A"][3:] *= 1e-3  # device 0's last rank has nearly faded
    loud.tensors[f"{MODULE}.lora_A"][3:] *= 1e3
    slots = rule.aggregate(slots, [faded, loud])
    assert [rule.kept_rank(slots, d, f"{MODULE}.lora_A") for d in (0, 1)] == [3, 4]
    assert rule.message_for(slots, 0)[f"{MODULE}.lora_B"].shape == (5, 3)
    assert rule.reference(slots, 0)[f"{MODULE}.lora_B"].shape == (5, 4)  # uploads stay at full rank
    later = rule.aggregate(slots, [_update(0, 4, seed=4), _update(1, 4, seed=5)])
    assert rule.kept_rank(later, 0, f"{MODULE}.lora_A") <= 3  # a cut is for good


def test_when_every_device_prunes_a_module_the_server_still_takes_full_rank_uploads():
    """Regression: the server's matrices shrank to the largest *kept* rank, so once every
    device had cut a module the full-rank uploads were rejected as the wrong shape."""
    rule = HetLoRARule(ranks=(4, 4), pruning_strength=0.75)
    slots = rule.aggregate(rule.initial_slots(), [_update(0, 4, seed=0), _update(1, 4, seed=1)])
    faded = [_update(0, 4, seed=2), _update(1, 4, seed=3)]
    for update in faded:
        update.tensors[f"{MODULE}.lora_A"][3:] *= 1e-3
    slots = rule.aggregate(slots, faded)
    assert [rule.kept_rank(slots, d, f"{MODULE}.lora_A") for d in (0, 1)] == [3, 3]
    assert slots[GLOBAL][f"{MODULE}.lora_A"].shape == (4, 6)
    assert rule.reference(slots, 0)[f"{MODULE}.lora_A"].shape == (4, 6)
    assert rule.reference(slots, 1)[f"{MODULE}.lora_B"].shape == (5, 4)
    assert rule.message_for(slots, 0)[f"{MODULE}.lora_A"].shape == (3, 6)


def test_hetlora_without_pruning_keeps_every_rank():
    rule = HetLoRARule(ranks=(4, 4))
    slots = rule.aggregate(rule.initial_slots(), [_update(0, 4, seed=0), _update(1, 4, seed=1)])
    faded = _update(0, 4, seed=2)
    faded.tensors[f"{MODULE}.lora_A"][3:] *= 1e-3
    slots = rule.aggregate(slots, [faded, _update(1, 4, seed=3)])
    assert rule.kept_rank(slots, 0, f"{MODULE}.lora_A") == 4 and "ranks" not in slots


@pytest.mark.parametrize("tiny_model", ["gpt2"], indirect=True)
def test_a_pruned_device_pads_what_it_receives_and_holds_the_cut_ranks_at_zero(tiny_model):
    from ondevice_moe.server_rules.rank_pruning import fit_received, pruning_penalty, routed_loras
    from ondevice_moe.training import DeviceTrainer, TrainingConfig

    method = method_for("hetlora", 1, ranks=[4], pruning_lambda=0.5, pruning_strength=0.75)
    model = attach_layout(tiny_model, method.layouts[0], seed=0)
    path, lora = next(iter(routed_loras(model).items()))
    sent = {f"{path}.lora_A": torch.randn(3, lora.lora_A.shape[1]),
            f"{path}.lora_B": torch.randn(lora.lora_B.shape[0], 3)}
    model.load_state_dict(fit_received(model, sent), strict=False)
    assert lora.kept_rank == 3 and torch.equal(lora.lora_A[:3], sent[f"{path}.lora_A"])
    penalty = pruning_penalty(model, 0.75)
    by_hand = sum(torch.linalg.norm(m.lora_A[int(0.75 * r):r]) * torch.linalg.norm(m.lora_B[:, int(0.75 * r):r])
                  for m in routed_loras(model).values() for r in [getattr(m, "kept_rank", m.rank)])
    torch.testing.assert_close(penalty, by_hand)
    trainer = DeviceTrainer(model, method, TrainingConfig())
    batch = {"input_ids": torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))}
    trainer.train_iterations(2, lambda _: {**batch, "labels": batch["input_ids"]}, lambda _: batch)
    assert not lora.lora_A[3:].any() and not lora.lora_B[:, 3:].any()
    assert lora.lora_A[:3].any()
