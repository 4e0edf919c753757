"""One expert system: every kind, in every role, under every router, on GPT-2, LLaMA and BERT."""

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from ondevice_moe.errors import UserError
from ondevice_moe.layout import ExpertSpec, Layout, RouterSpec, attach_layout, routing_sites
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


def _layout(kinds, router="none", role="shared", mixing="block", top_k=2) -> Layout:
    return Layout(experts=tuple(ExpertSpec(kind, role) for kind in kinds), router=RouterSpec(router, top_k=top_k),
                  mixing=mixing)


def _close_prefixes(model, weight: float, tokens) -> None:
    """Gate every prefix expert to a fixed weight (a fresh prefix is not a no-op; gated to 0 it must be)."""
    for attention in (m for m in model.modules() if hasattr(m, "prefix_gates")):
        attention.prefix_gates = {name: (lambda: torch.full((*tokens.shape, 1), weight)) for name in attention.prefix}


@pytest.mark.parametrize("kinds", [("lora",), ("adapter",), ("prefix",), ("lora", "adapter", "prefix")])
def test_fresh_experts_leave_outputs_unchanged(any_model, tokens, kinds):
    reference = _logits(any_model, tokens)
    model = attach_layout(any_model, _layout(kinds, "none" if len(kinds) == 1 else "hermes"), seed=0).eval()
    _close_prefixes(model, 0.0, tokens)
    torch.testing.assert_close(_logits(model, tokens), reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("router", ["none", "uniform", "token-topk", "hermes", "sigmoid"])
@pytest.mark.parametrize("role", ["shared", "private"])
@pytest.mark.parametrize("kind", ["lora", "adapter", "prefix"])
def test_every_kind_in_every_role_under_every_router_starts_as_the_base(any_model, tokens, kind, role, router):
    reference = _logits(any_model, tokens)
    layout = _layout((kind, kind), router, role)
    model = attach_layout(any_model, layout, seed=0, user=1).eval()
    _close_prefixes(model, 0.0, tokens)
    torch.testing.assert_close(_logits(model, tokens), reference, rtol=0, atol=1e-5)
    names = {n for n, _ in model.named_parameters()}
    assert any(f".{role}_1." in n for n in names), "expert names carry the role"


@pytest.mark.parametrize("router", ["uniform", "token-topk", "hermes"])
@pytest.mark.parametrize("role", ["shared", "private"])
@pytest.mark.parametrize("kinds", [("lora", "lora"), ("adapter", "adapter"), ("adapter", "lora")])
def test_mlp_mixtures_of_any_kind_start_as_the_base(tiny_model, tokens, kinds, role, router):
    reference = _logits(tiny_model, tokens)
    model = attach_layout(tiny_model, _layout(kinds, router, role, mixing="mlp"), seed=0).eval()
    torch.testing.assert_close(_logits(model, tokens), reference, rtol=0, atol=1e-5)
    assert len(routing_sites(model)) == tiny_model.config.num_hidden_layers


def test_prefix_in_the_mlp_mixture_and_mlp_mixture_on_bert_are_refused(any_model):
    with pytest.raises(UserError, match="mixing: block"):
        _layout(("prefix", "lora"), "token-topk", mixing="mlp")
    if any_model.config.model_type == "bert":
        with pytest.raises(UserError, match="mixing: block"):
            attach_layout(any_model, _layout(("lora", "lora"), "token-topk", mixing="mlp"), seed=0)


def test_prefix_weight_one_equals_plain_prefix_attention(any_model, tokens):
    plain = attach_layout(any_model, _layout(("prefix",)), seed=0).eval()
    expected = _logits(plain, tokens)
    _close_prefixes(plain, 1.0, tokens)
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
    model = attach_layout(any_model, _layout(("lora", "adapter", "prefix"), "hermes"), seed=0)
    routers = routing_sites(model)
    assert len(routers) == any_model.config.num_hidden_layers
    _logits(model, tokens)
    assert all(r.current is not None and r.current.shape[-1] == 3 for r in routers)


def test_unknown_kind_and_oversized_k_are_refused():
    with pytest.raises(UserError, match="unknown expert kind"):
        _layout(("lora", "ia3"))
    with pytest.raises(UserError, match="top_k = 3 but each block holds 2"):
        _layout(("lora", "adapter"), "hermes", top_k=3)
