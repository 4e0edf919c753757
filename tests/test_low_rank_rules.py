"""HetLoRA and FlexLoRA: devices with different LoRA ranks (CoMiGS Table 1 baselines)."""

import math

import pytest
import torch

from ondevice_moe.errors import UserError
from ondevice_moe.federation.aggregation import Update
from ondevice_moe.federation.low_rank_rules import FlexLoRARule, HetLoRARule
from ondevice_moe.federation.rules import GLOBAL
from ondevice_moe.layout import attach_layout
from ondevice_moe.methods import method_for

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
