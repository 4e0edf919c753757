import math

import pytest
import torch
from test_mixture import naive_mixture
from torch import nn

from ondevice_moe.experts import LoRA, LoRAAdaptedLinear
from ondevice_moe.experts.adapter import Adapter
from ondevice_moe.experts.lora import add_gated
from ondevice_moe.layout import Layout, RouterSpec, attach_layout, lora_experts
from ondevice_moe.mixture import mixtures


def _comigs_layout(*roles: str) -> Layout:
    """CoMiGS's default device: attention LoRA plus LoRA experts of ``roles`` in the MLP under a top-k router."""
    return Layout(experts=lora_experts(roles or ("shared", "private")), router=RouterSpec("token-topk"),
                  mixing="mlp", attention_lora="shared")


def test_fresh_experts_leave_outputs_unchanged(tiny_model, tokens):
    reference = tiny_model(tokens).logits
    model = attach_layout(tiny_model, _comigs_layout(), seed=0, user=3).eval()
    assert len(mixtures(model)) == tiny_model.config.num_hidden_layers
    # Σ_j w_j·MLP(x) = MLP(x) up to the rounding of weights that sum to one
    torch.testing.assert_close(model(tokens).logits, reference, rtol=1e-5, atol=1e-5)


def test_every_expert_of_a_fresh_four_expert_device_receives_tokens_on_step_one(tiny_model, tokens):
    model = attach_layout(tiny_model, _comigs_layout("shared", "private", "private", "private"), seed=0).train()
    model(tokens)
    for mixture in mixtures(model):
        assert (mixture.last_scores > 0).all(), mixture.last_scores


def test_attached_model_shares_frozen_weights_and_trains_only_experts(tiny_model):
    model = attach_layout(tiny_model, _comigs_layout(), seed=0)
    base_params = {p.data_ptr() for p in tiny_model.parameters()}
    for name, param in model.named_parameters():
        is_expert = name.endswith(("lora_A", "lora_B")) or ".router." in name
        assert param.requires_grad is False or is_expert, name
        if not is_expert:
            assert param.data_ptr() in base_params, f"{name} was copied instead of shared"


def test_lora_scaling_is_alpha_over_sqrt_rank():
    lora = LoRA(5, 3, rank=4, alpha=16.0, generator=torch.Generator().manual_seed(0))
    assert lora.scaling == pytest.approx(16.0 / math.sqrt(4))
    with torch.no_grad():
        lora.lora_B.copy_(torch.randn(3, 4))
    x = torch.randn(2, 5)
    expected = 8.0 * x @ lora.lora_A.T @ lora.lora_B.T
    torch.testing.assert_close(lora(x), expected)


def test_adapted_linear_adds_each_adapter():
    base = nn.Linear(4, 6)
    adapters = {"shared": LoRA(4, 6, 2, 4.0), "private": LoRA(4, 6, 2, 4.0)}
    for adapter in adapters.values():
        nn.init.normal_(adapter.lora_B)
    layer = LoRAAdaptedLinear(base, adapters)
    x = torch.randn(3, 4)
    torch.testing.assert_close(layer(x), base(x) + adapters["shared"](x) + adapters["private"](x))


@pytest.mark.parametrize("expert", [LoRA(6, 6, 2, 4.0), Adapter(6, rank=3)], ids=["lora", "adapter"])
def test_fused_add_equals_output_plus_weighted_residual(expert):
    with torch.no_grad():
        for param in expert.parameters():
            param.normal_(0, 0.5)
    expert.double()
    out, x = torch.randn(2, 5, 6, dtype=torch.float64), torch.randn(2, 5, 6, dtype=torch.float64)
    weight = torch.rand(2, 5, 1, dtype=torch.float64)
    torch.testing.assert_close(expert.add_to(out, x, weight), out + weight * expert(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(expert.add_to(out, x), out + expert(x), rtol=1e-12, atol=1e-12)


def test_float32_experts_compute_in_a_bfloat16_base_dtype_and_keep_float32_gradients():
    lora = LoRA(8, 8, 2, 4.0)
    nn.init.normal_(lora.lora_B)
    x = torch.randn(3, 8)
    out = lora.add_to(torch.zeros(3, 8, dtype=torch.bfloat16), x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert lora.lora_A.grad.dtype == lora.lora_B.grad.dtype == torch.float32
    torch.testing.assert_close(out.float(), lora(x), rtol=0.05, atol=0.05 * lora(x).abs().max().item())


def test_shared_experts_start_identical_across_users_private_ones_differ(tiny_model):
    layout = _comigs_layout("shared", "private")
    first = dict(attach_layout(tiny_model, layout, seed=0, user=0).named_parameters())
    second = dict(attach_layout(tiny_model, layout, seed=0, user=1).named_parameters())
    shared_a = [n for n in first if ".shared_0." in n and n.endswith("lora_A")]
    private_a = [n for n in first if ".private_0." in n and n.endswith("lora_A")]
    assert shared_a and private_a
    assert all(torch.equal(first[n], second[n]) for n in shared_a)
    assert not any(torch.equal(first[n], second[n]) for n in private_a)


def test_single_pass_mixture_equals_per_expert_mlps(tiny_model):
    layout = _comigs_layout("shared", "private", "private")
    model = attach_layout(tiny_model, layout, seed=0).eval()
    mixture = mixtures(model)[0]
    with torch.no_grad():
        for param in mixture.parameters():
            if param.requires_grad:
                param.normal_(0, 0.2)
    hidden = torch.randn(2, 7, tiny_model.config.hidden_size)
    expected = naive_mixture(mixture, hidden)
    # float32 rounding of differently ordered sums, relative to outputs in the hundreds
    torch.testing.assert_close(mixture(hidden), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_gated_experts_add_in_one_product_what_they_add_one_by_one():
    generator = torch.Generator().manual_seed(0)
    experts = [LoRA(6, 5, rank, 2.0, generator) for rank in (1, 2, 3)]
    for expert in experts:
        torch.nn.init.normal_(expert.lora_B, generator=generator)
    x, out = torch.randn(2, 4, 6, generator=generator), torch.randn(2, 4, 5, generator=generator)
    weights = [torch.rand(2, 4, 1, generator=generator), torch.tensor(0.3), None]
    one_by_one = out
    for expert, weight in zip(experts, weights, strict=True):
        one_by_one = one_by_one + (expert(x) if weight is None else weight * expert(x))
    torch.testing.assert_close(add_gated(out, x, list(zip(experts, weights, strict=True))), one_by_one)
