"""Hermes experts (LoRA, Adapter, Prefix) in every block under one router."""

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from ondevice_moe.block_experts import BlockLayout, attach_block_experts, block_routers
from ondevice_moe.errors import UserError
from ondevice_moe.models.tiny import tiny_gpt2, tiny_llama
from ondevice_moe.routing.hermes import HermesRouter
from ondevice_moe.routing.topk import top_k_softmax


@pytest.fixture(params=["gpt2", "llama", "bert"])
def any_model(request):
    if request.param != "bert":
        model = (tiny_gpt2 if request.param == "gpt2" else tiny_llama)(257)
        return model.eval().requires_grad_(False)
    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        vocab_size=257, num_labels=3)
    return BertForSequenceClassification(config).eval().requires_grad_(False)


def _logits(model, tokens):
    return model(input_ids=tokens).logits


@pytest.mark.parametrize("kinds", [("lora",), ("adapter",), ("prefix",), ("lora", "adapter", "prefix")])
def test_fresh_experts_leave_outputs_unchanged(any_model, tokens, kinds):
    reference = _logits(any_model, tokens)
    if "prefix" in kinds:
        # A fresh prefix is not a no-op; gated to weight 0 it must be.
        layout = BlockLayout(experts=kinds, router="none" if len(kinds) == 1 else "hermes")
        model = attach_block_experts(any_model, layout, seed=0).eval()
        for attention in (m for m in model.modules() if hasattr(m, "prefix")):
            attention.prefix_gate = lambda: torch.zeros(*tokens.shape, 1)
    else:
        layout = BlockLayout(experts=kinds, router="none" if len(kinds) == 1 else "hermes")
        model = attach_block_experts(any_model, layout, seed=0).eval()
    torch.testing.assert_close(_logits(model, tokens), reference, rtol=0, atol=1e-5)


def test_prefix_weight_one_equals_plain_prefix_attention(any_model, tokens):
    plain = attach_block_experts(any_model, BlockLayout(experts=("prefix",), router="none"), seed=0).eval()
    expected = _logits(plain, tokens)
    for attention in (m for m in plain.modules() if hasattr(m, "prefix")):
        attention.prefix_gate = lambda: torch.ones(*tokens.shape, 1)
    torch.testing.assert_close(_logits(plain, tokens), expected)
    assert not torch.allclose(expected, _logits(any_model, tokens)), "a plain prefix must change the output"


def test_top_k_selects_exactly_k_experts_per_token():
    router = HermesRouter(8, ("lora", "adapter", "prefix"), top_k=2)
    torch.nn.init.normal_(router.gate.weight)
    weights = router(torch.randn(4, 5, 8)).weights
    assert torch.all((weights > 0).sum(-1) == 2)
    torch.testing.assert_close(weights.sum(-1), torch.ones(4, 5))


def test_sparse_softmax_uses_temperature():
    scores = torch.tensor([[0.3, 0.1, 0.2]])
    weights, selected = top_k_softmax(scores, 2, temperature=0.1)
    expected = torch.softmax(torch.tensor([0.3, 0.2]) / 0.1, -1)
    torch.testing.assert_close(weights[0, [0, 2]], expected)
    assert selected.tolist() == [[1.0, 0.0, 1.0]]


def test_bias_moves_usage_toward_balance():
    router = HermesRouter(4, ("lora", "adapter", "prefix"), top_k=1, bias_rate=0.05, use_gradient=False)
    with torch.no_grad():  # expert 0 is favoured by most tokens; experts 1 and 2 split the rest
        router.gate.weight.copy_(torch.tensor([[6.0, 0, 0, 0], [0, 2.0, 0, 0], [0, -2.0, 0, 0]]))
    generator = torch.Generator().manual_seed(0)
    hidden = torch.zeros(300, 4)
    hidden[:, 0] = torch.rand(300, generator=generator)
    hidden[:, 1] = torch.randn(300, generator=generator)
    router.train()
    ideal = 300 / 3

    def imbalance() -> float:
        counts = router(hidden).weights.gt(0).sum(0).float()
        return float((counts - ideal).abs().sum())

    before = imbalance()
    history = []
    for _ in range(60):
        history.append(imbalance())
        router.update_bias()
    assert before > 150, "the constructed batch must start imbalanced"
    assert sum(history[-10:]) / 10 < before / 3
    assert router.bias[0] < 0


def test_gradient_view_is_an_ema_of_normalised_norms():
    router = HermesRouter(4, ("lora", "adapter"), top_k=1, gradient_ema=0.5)
    router.update_gradient_view(torch.tensor([3.0, 1.0]))
    torch.testing.assert_close(router.gradient_score, torch.tensor([0.5 * 0.5 + 0.5 * 0.75, 0.5 * 0.5 + 0.5 * 0.25]))


def test_router_sits_on_every_block_and_sees_its_input(any_model, tokens):
    model = attach_block_experts(any_model, BlockLayout(), seed=0)
    routers = block_routers(model)
    assert len(routers) == any_model.config.num_hidden_layers
    _logits(model, tokens)
    assert all(r.current is not None and r.current.shape[-1] == 3 for r in routers)


def test_unknown_kind_and_oversized_k_are_refused():
    with pytest.raises(UserError, match="unknown expert kind"):
        BlockLayout(experts=("lora", "ia3"))
    with pytest.raises(UserError, match="top_k = 3 but each block holds 2"):
        BlockLayout(experts=("lora", "adapter"), top_k=3)
