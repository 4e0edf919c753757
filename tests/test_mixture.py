"""The exact MLP mixture (CoMiGS §2): LoRA and Adapter experts against a naive per-expert implementation."""

import pytest
import torch
from torch import nn

from ondevice_moe.experts import LoRA
from ondevice_moe.experts.adapter import Adapter, AdapterAfter
from ondevice_moe.mixture import MixtureMLP, gpt2_mixed_forward, llama_mixed_forward
from ondevice_moe.routing import TokenTopKRouter, UniformRouter

FORMS = {  # family: (MLP of block 0, linear layers of the MLP, mixed forward)
    "gpt2": (lambda model: model.transformer.h[0].mlp, ("c_fc", "c_proj"), gpt2_mixed_forward),
    "llama": (lambda model: model.model.layers[0].mlp, ("gate_proj", "up_proj", "down_proj"), llama_mixed_forward),
}


def _lora_expert(mlp: nn.Module, linears: tuple[str, ...]) -> nn.ModuleDict:
    def features(layer: nn.Module) -> tuple[int, int]:
        weight = layer.weight
        return (weight.shape[0], weight.shape[1]) if type(layer).__name__ == "Conv1D" else \
            (weight.shape[1], weight.shape[0])

    return nn.ModuleDict({name: LoRA(*features(getattr(mlp, name)), rank=4, alpha=8.0) for name in linears})


def _mixture(model: nn.Module, kinds: tuple[str, ...], dtype: torch.dtype = torch.float64) -> MixtureMLP:
    """A mixture over block 0's MLP with experts of ``kinds`` and random (non-zero) expert and router weights."""
    arch = model.config.model_type
    get_mlp, linears, forward = FORMS[arch]
    mlp = get_mlp(model)
    hidden = model.config.hidden_size
    experts = {f"e{j}": Adapter(hidden, rank=6) if kind == "adapter" else _lora_expert(mlp, linears)
               for j, kind in enumerate(kinds)}
    router = TokenTopKRouter(hidden, len(kinds), top_k=min(2, len(kinds))) if len(kinds) > 1 \
        else UniformRouter(1)
    mixture = MixtureMLP(mlp, experts, router, forward).to(dtype)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in mixture.parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=dtype) * 0.2)
    return mixture


def naive_mixture(mixture: MixtureMLP, hidden: torch.Tensor) -> torch.Tensor:
    """``Σ_j w_j E_j(x)``, running the frozen MLP once per expert."""
    base = mixture.base
    weights = mixture.router(hidden).weights
    outputs = []
    for expert in mixture.experts.values():
        if isinstance(expert, Adapter):
            out = base(hidden)
            outputs.append(out + expert(out))
        elif hasattr(base, "c_fc"):
            act = base.act(base.c_fc(hidden) + expert["c_fc"](hidden))
            outputs.append(base.c_proj(act) + expert["c_proj"](act))
        else:
            act = base.act_fn(base.gate_proj(hidden) + expert["gate_proj"](hidden)) * (
                base.up_proj(hidden) + expert["up_proj"](hidden))
            outputs.append(base.down_proj(act) + expert["down_proj"](act))
    return sum(weights[..., j : j + 1] * out for j, out in enumerate(outputs))


def _output_and_grads(mixture: MixtureMLP, hidden: torch.Tensor, forward) -> tuple[torch.Tensor, list[torch.Tensor]]:
    hidden = hidden.clone().requires_grad_(True)
    out = forward(hidden)
    params = [p for p in mixture.parameters() if p.requires_grad]
    upstream = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    grads = torch.autograd.grad((out * upstream).sum(), [hidden, *params])
    return out.detach(), list(grads)


@pytest.mark.parametrize("kinds", [("lora", "lora", "lora"), ("lora", "adapter"), ("adapter", "lora", "adapter")])
def test_mixture_equals_naive_per_expert_mlps_forward_and_gradients(tiny_model, kinds):
    mixture = _mixture(tiny_model, kinds)
    hidden = torch.randn(2, 7, tiny_model.config.hidden_size, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(2))
    out, grads = _output_and_grads(mixture, hidden, mixture)
    expected_out, expected_grads = _output_and_grads(mixture, hidden, lambda h: naive_mixture(mixture, h))
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-10)
    assert len(grads) == len(expected_grads) > 1 + len(kinds)
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert expected.abs().sum() > 0  # every expert and the router take part
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-10)


def test_mixture_without_grad_equals_mixture_with_grad(tiny_model):
    mixture = _mixture(tiny_model, ("lora", "adapter"), torch.float32)
    hidden = torch.randn(3, 5, tiny_model.config.hidden_size)
    with torch.no_grad():
        plain = mixture(hidden)
    assert torch.equal(mixture(hidden), plain)


def test_single_adapter_expert_is_the_mlp_followed_by_its_adapter(tiny_model):
    mixture = _mixture(tiny_model, ("adapter",))
    hidden = torch.randn(2, 4, tiny_model.config.hidden_size, dtype=torch.float64)
    reference = AdapterAfter(mixture.base, {"e0": mixture.experts["e0"]})
    torch.testing.assert_close(mixture(hidden), reference(hidden), rtol=1e-12, atol=1e-12)


def test_mixture_runs_in_bfloat16_with_float32_experts(tiny_model):
    mixture = _mixture(tiny_model, ("lora", "adapter"), torch.float32)
    hidden = torch.randn(2, 4, tiny_model.config.hidden_size)
    with torch.no_grad():
        expected = naive_mixture(mixture, hidden)
    mixture.base.to(torch.bfloat16)
    out = mixture(hidden.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in mixture.experts.parameters())
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05 * expected.abs().max().item())
