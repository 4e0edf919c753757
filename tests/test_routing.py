import pytest
import torch

from ondevice_moe.routing import TokenTopKRouter, UniformRouter, generalist_balance_loss, switch_balance_loss


def _router(num_experts: int, top_k: int) -> TokenTopKRouter:
    router = TokenTopKRouter(hidden_size=6, num_experts=num_experts, top_k=top_k)
    torch.nn.init.normal_(router.gate.weight, generator=torch.Generator().manual_seed(0))
    return router


@pytest.mark.parametrize(("num_experts", "top_k"), [(2, 2), (4, 2), (4, 1), (3, 3)])
def test_top_k_weights_renormalise(num_experts, top_k):
    router = _router(num_experts, top_k)
    hidden = torch.randn(5, 9, 6)
    weights = router(hidden).weights
    assert torch.all((weights > 0).sum(-1) == top_k)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5, 9))
    probs = torch.softmax(router.gate(hidden), -1)
    top = probs.topk(top_k, -1)
    expected = torch.zeros_like(probs).scatter(-1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(weights, expected)


def test_fresh_router_sends_tokens_to_every_expert():
    router = TokenTopKRouter(16, 4, top_k=2, generator=torch.Generator().manual_seed(0))
    weights = router(torch.randn(64, 16, generator=torch.Generator().manual_seed(1))).weights
    assert (weights > 0).any(dim=0).all()


def test_fresh_router_gate_is_drawn_like_nn_linear_from_its_generator():
    first, second = (TokenTopKRouter(100, 4, generator=torch.Generator().manual_seed(3)) for _ in range(2))
    assert torch.equal(first.gate.weight, second.gate.weight)
    bound = 1 / 100 ** 0.5
    assert first.gate.weight.abs().max() <= bound and first.gate.weight.std() > bound / 2


def test_uniform_router():
    routing = UniformRouter(4)(torch.randn(2, 3, 6))
    torch.testing.assert_close(routing.weights, torch.full((2, 3, 4), 0.25))
    assert float(routing.balance_loss) == 0.0


def test_top_k_larger_than_experts_is_rejected():
    with pytest.raises(ValueError, match="top_k"):
        TokenTopKRouter(6, 2, top_k=3)


# Hand-worked example: 2 tokens, 3 experts, top-2.
PROBS = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
SELECTED = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
# f = [0.5, 1.0, 0.5], P = [0.3, 0.45, 0.25]


def test_switch_balance_loss_by_hand():
    # (n/k) Σ f_j P_j = 1.5 * (0.15 + 0.45 + 0.125) = 1.0875
    assert float(switch_balance_loss(PROBS, SELECTED, top_k=2)) == pytest.approx(1.0875)


def test_generalist_balance_loss_by_hand():
    # n = 3: coefficients 1/5 for the generalist, 2/5 for the others (CoMiGS eq. 6)
    expected = 0.2 * 0.5 * 0.3 + 0.4 * 1.0 * 0.45 + 0.4 * 0.5 * 0.25
    assert float(generalist_balance_loss(PROBS, SELECTED)) == pytest.approx(expected)


def test_generalist_form_with_two_experts_is_proportional_to_switch():
    probs = torch.tensor([[0.7, 0.3], [0.2, 0.8], [0.6, 0.4]])
    selected = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    # n = 2: eq. 6 gives ½ Σ f P; the Switch form with k = 1 gives 2 Σ f P.
    assert float(generalist_balance_loss(probs, selected)) == pytest.approx(
        float(switch_balance_loss(probs, selected, top_k=1)) / 4)
