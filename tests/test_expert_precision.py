"""The experts' product dtype (issue 64): training and evaluation compute an expert in the dtype of the layer
it adapts; ``products_in(torch.float32)`` — what generation uses — computes its products in float32 on a bf16
base and rounds the sum once, as PEFT does, while the experts' code paths (LoRA, adapter, the fused
stacks, the MLP mixture) stay the same."""

import pytest
import torch

from ondevice_moe.experts.adapter import Adapter, add_adapters
from ondevice_moe.experts.lora import LoRA, add_gated
from ondevice_moe.experts.precision import product_dtype, products_in
from ondevice_moe.generate import Sampling, generate_tokens
from ondevice_moe.mixture import LLAMA_MLP, mixed_mlp, stacked_mixed_mlp
from ondevice_moe.models.tiny import tiny_llama

BF16 = torch.bfloat16


def _moved(module: torch.nn.Module, seed: int, scale: float = 0.3) -> torch.nn.Module:
    """Parameters off their initialisation (a zero ``B`` or ``up`` would add nothing in any dtype)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return module


def _inputs(width: int = 32, tokens: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, tokens, width, generator=generator).to(BF16)
    out = torch.randn(2, tokens, width, generator=generator).to(BF16)
    gate = torch.rand(2, tokens, 1, generator=generator).to(BF16)
    return x, out, gate


def _sites() -> dict[str, object]:
    loras = [_moved(LoRA(32, 32, rank=4, alpha=8.0), seed) for seed in (1, 2)]
    adapters = [_moved(Adapter(32, rank=6), seed) for seed in (3, 4)]
    return {
        "lora forward": lambda x, out, gate: loras[0](x),
        "lora add_to": lambda x, out, gate: loras[0].add_to(out, x, gate),
        "gated loras": lambda x, out, gate: add_gated(out, x, [(loras[0], gate), (loras[1], None)]),
        "gated loras, fused": lambda x, out, gate: add_gated(out, x, [(loras[0], gate), (loras[1], None)], fused=True),
        "adapter forward": lambda x, out, gate: adapters[0](x),
        "adapter add_to": lambda x, out, gate: adapters[0].add_to(out, x, gate),
        "adapters, fused": lambda x, out, gate: add_adapters(out, x, [(adapters[0], gate), (adapters[1], None)]),
    }


@pytest.mark.parametrize("site", sorted(_sites()))
def test_float32_products_on_a_bf16_layer_are_the_float32_result_rounded_once(site):
    compute = _sites()[site]
    x, out, gate = _inputs()
    with products_in(torch.float32):
        got = compute(x, out, gate)
    assert got.dtype == BF16
    assert torch.equal(got, compute(x.float(), out.float(), gate.float()).to(BF16))
    assert not torch.equal(compute(x, out, gate), got), "outside the block the products stay in bf16"


def test_the_product_dtype_is_the_layers_own_outside_the_block_even_after_an_error():
    like = torch.zeros(1, dtype=BF16)
    assert product_dtype(like) == BF16
    with pytest.raises(RuntimeError), products_in(torch.float32):
        assert product_dtype(like) == torch.float32
        raise RuntimeError("a failed generation")
    assert product_dtype(like) == BF16


def test_the_mlp_mixture_stacked_and_expert_by_expert_agree_with_float32_products_on_a_bf16_base():
    mlp = tiny_llama(64).model.layers[0].mlp.to(BF16)
    width = mlp.gate_proj.in_features
    experts = [_moved(torch.nn.ModuleDict({name: LoRA(*_features(getattr(mlp, name)), rank=4)
                                           for name in ("gate_proj", "up_proj", "down_proj")}), seed, scale=0.05)
               for seed in (5, 6)]
    x = torch.randn(2, 7, width, generator=torch.Generator().manual_seed(8)).to(BF16)
    weights = torch.softmax(torch.randn(2, 7, 2, generator=torch.Generator().manual_seed(9)), dim=-1)
    with torch.no_grad(), products_in(torch.float32):
        stacked = stacked_mixed_mlp(LLAMA_MLP, mlp, experts, weights, x)
        one_by_one = mixed_mlp(LLAMA_MLP, mlp, experts, weights, x)
    with torch.no_grad():
        in_bf16 = stacked_mixed_mlp(LLAMA_MLP, mlp, experts, weights, x)
    assert stacked.dtype == BF16
    torch.testing.assert_close(stacked, one_by_one, rtol=2e-2, atol=2e-2)
    assert not torch.equal(stacked, in_bf16)


def _features(layer: torch.nn.Linear) -> tuple[int, int]:
    return layer.in_features, layer.out_features


def test_generation_runs_the_experts_products_in_float32():
    model = tiny_llama(64).eval()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(product_dtype(torch.zeros(1, dtype=BF16))))
    generate_tokens(model, torch.tensor([[5, 6, 7]]), 3, Sampling(), 0)
    assert seen and set(seen) == {torch.float32}
