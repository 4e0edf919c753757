"""Fused experts (issue 64, ``training.fused_experts``): every expert site computes its experts batched,
and a device's model gives the same outputs and the same gradients as the unfused one, to float
rounding, for every expert kind and role of every method that runs on a language model or a
classifier."""

from pathlib import Path

import pytest
import torch
from method_cases import CLASSIFICATION, LANGUAGE_MODELLING, case_name, method_recipe
from torch import nn

from ondevice_moe.experts.adapter import Adapter, add_adapters
from ondevice_moe.experts.lora import LoRA, add_gated
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.layout.fused import FUSABLE_SITES, fuse_experts
from ondevice_moe.mixture import GPT2_MLP, LLAMA_MLP, mixed_mlp, stacked_mixed_mlp
from ondevice_moe.models.tiny import tiny_gpt2, tiny_llama
from ondevice_moe.recipe import validate_recipe

# Beside the method cases: an MLP mixture that holds an adapter expert beside LoRA experts (CoMiGS's
# mixture with the adapter kind), and one with three LoRA experts of two roles.
MLP_MIXTURES = [
    {"name": "mixture", "experts": [{"kind": "adapter", "role": "shared"}, {"kind": "lora", "role": "private"},
                                    {"kind": "lora", "role": "shared"}], "router": "token-topk", "mixing": "mlp"},
    {"name": "mixture", "experts": [{"kind": "lora", "role": "shared"}, {"kind": "lora", "role": "private"},
                                    {"kind": "lora", "role": "private"}], "router": "token-topk", "mixing": "mlp"},
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _job(folder: Path, method, classification: bool, dtype: str = "float32", quantization: str = "none",
         **training) -> Job:
    raw = method_recipe(folder, quantization, method, classification)
    raw["model"]["dtype"] = dtype
    raw["training"].update(training)
    return Job(validate_recipe(raw), 0, Path("."))


def _perturbed(model: nn.Module) -> nn.Module:
    """Every trainable tensor moved off its initialisation (LoRA's B and an adapter's up start at zero,
    where every expert adds nothing and a wrong mixture would go unseen)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator).to(parameter.dtype))
    return model


def _outputs_and_gradients(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.eval()
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _assert_fused_equals_unfused(job: Job, vocab: int) -> None:
    # Built twice, not copied: a copy's gates would still read the first model's routers.
    unfused, fused = _perturbed(dev.build_model(job, 0)), _perturbed(dev.build_model(job, 0))
    assert fuse_experts(fused) == sum(isinstance(m, FUSABLE_SITES) for m in fused.modules())
    ids = torch.randint(0, vocab - 1, (2, 12), generator=torch.Generator().manual_seed(1))
    logits, grads = _outputs_and_gradients(unfused, ids)
    fused_logits, fused_grads = _outputs_and_gradients(fused, ids)
    tolerance = TOLERANCE[logits.dtype]
    torch.testing.assert_close(fused_logits, logits, rtol=tolerance, atol=tolerance)
    assert fused_grads.keys() == grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize("method", LANGUAGE_MODELLING + MLP_MIXTURES, ids=case_name)
def test_a_causal_lms_fused_experts_give_its_outputs_and_gradients(saved_tiny_models, method):
    _assert_fused_equals_unfused(_job(saved_tiny_models["tiny-llama"], method, False), 257)


@pytest.mark.parametrize("method", [{"name": "comigs", "variant": "1G1S"}, "hermes", *MLP_MIXTURES], ids=case_name)
def test_fused_experts_on_a_bfloat16_base_give_its_outputs_and_gradients(saved_tiny_models, method):
    _assert_fused_equals_unfused(_job(saved_tiny_models["tiny-llama"], method, False, dtype="bfloat16"), 257)


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
@pytest.mark.parametrize("method", [{"name": "comigs", "variant": "1G1S"}, "hermes", MLP_MIXTURES[0]], ids=case_name)
def test_fused_experts_on_a_quantized_base_give_its_outputs_and_gradients(saved_tiny_models, method, quantization):
    job = _job(saved_tiny_models["tiny-llama"], method, False, quantization=quantization)
    layers = {type(module).__name__ for module in dev.build_model(job, 0).modules()}
    assert layers & {"Linear4bit", "Linear8bitLt"}, "the base is quantized"
    _assert_fused_equals_unfused(job, 257)


@pytest.mark.parametrize("method", CLASSIFICATION, ids=case_name)
def test_a_classifiers_fused_experts_give_its_outputs_and_gradients(saved_tiny_models, method):
    _assert_fused_equals_unfused(_job(saved_tiny_models["tiny-bert"], method, True), 257)


def test_the_recipe_key_fuses_every_expert_site_of_a_devices_model(saved_tiny_models):
    method = {"name": "comigs", "variant": "1G1S"}
    fused = dev.build_model(_job(saved_tiny_models["tiny-llama"], method, False, fused_experts=True), 0)
    plain = dev.build_model(_job(saved_tiny_models["tiny-llama"], method, False), 0)
    fused_sites = [m.fused for m in fused.modules() if isinstance(m, FUSABLE_SITES)]
    assert fused_sites and all(fused_sites)
    assert not any(m.fused for m in plain.modules() if isinstance(m, FUSABLE_SITES))
    assert fused.state_dict().keys() == plain.state_dict().keys()  # checkpoints and exports unchanged


def _lora_expert(linears: dict[str, tuple[int, int]], rank: int, seed: int) -> nn.ModuleDict:
    generator = torch.Generator().manual_seed(seed)
    expert = nn.ModuleDict({name: LoRA(fan_in, fan_out, rank, 16.0, generator) for name, (fan_in, fan_out)
                            in linears.items()})
    with torch.no_grad():
        for lora in expert.values():
            lora.lora_B.normal_(0.0, 0.1, generator=generator)
    return expert


def _adapter(width: int, seed: int) -> Adapter:
    generator = torch.Generator().manual_seed(seed)
    adapter = Adapter(width, 4, generator)
    with torch.no_grad():
        adapter.up.normal_(0.0, 0.1, generator=generator)
    return adapter


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("ranks", [(4, 4, None), (4, 2, None)], ids=["equal ranks", "ranks differ"])
def test_the_stacked_mlp_mixture_equals_the_mixture_expert_by_expert(family, ranks):
    """GPT-2's and LLaMA's MLP forms, LoRA experts with an adapter expert; experts of different ranks
    cannot be stacked and take the expert-by-expert path (still equal)."""
    torch.manual_seed(0)
    model = tiny_gpt2(257) if family == "gpt2" else tiny_llama(257)
    form = GPT2_MLP if family == "gpt2" else LLAMA_MLP
    mlp = model.transformer.h[0].mlp if family == "gpt2" else model.model.layers[0].mlp
    linears = {name: (64, 256) for name in form.inputs} | {form.output: (256, 64)} if family == "gpt2" else \
        {name: (64, 128) for name in form.inputs} | {form.output: (128, 64)}
    experts = [_lora_expert(linears, rank, seed) for seed, rank in enumerate(ranks) if rank is not None]
    experts.append(_adapter(64, 7))
    mlp.eval()
    x = torch.randn(2, 5, 64, requires_grad=True)
    weights = torch.softmax(torch.randn(2, 5, len(experts)), dim=-1)
    outputs = [function(form, mlp, experts, weights, x) for function in (mixed_mlp, stacked_mixed_mlp)]
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    grads = [torch.autograd.grad(out.square().sum(), [x, *experts[0].parameters()]) for out in outputs]
    for fused, plain in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_lora_codes_equal_each_experts_codes(dtype):
    """Gated LoRAs on one layer (Hermes's query/value experts, FLoRAL's adaptors), of different ranks,
    one of them always on: the stacked ``A`` product gives each expert's own codes."""
    generator = torch.Generator().manual_seed(0)
    loras = [LoRA(16, 24, rank, 8.0, generator) for rank in (2, 4, 3)]
    for lora in loras:
        torch.nn.init.normal_(lora.lora_B, generator=generator)
    x = torch.randn(3, 7, 16, generator=generator).to(dtype)
    gates = [torch.rand(3, 7, 1, generator=generator), None, torch.rand(3, 7, 1, generator=generator)]
    out = torch.randn(3, 7, 24, generator=generator).to(dtype)
    experts = list(zip(loras, gates, strict=True))
    plain, fused = add_gated(out, x, experts), add_gated(out, x, experts, fused=True)
    assert fused.dtype == plain.dtype == dtype
    torch.testing.assert_close(fused, plain)  # the dtype's float tolerance: one stacked product sums in its own order


def test_adapters_added_from_two_products_equal_adapters_added_one_by_one():
    hidden = torch.randn(2, 6, 32)
    adapters = [_adapter(32, seed) for seed in range(3)]
    gates = [torch.rand(2, 6, 1), None, torch.rand(2, 6, 1)]
    one_by_one = hidden
    for adapter, gate in zip(adapters, gates, strict=True):
        one_by_one = adapter.add_to(one_by_one, hidden, gate)
    torch.testing.assert_close(add_adapters(hidden, hidden, list(zip(adapters, gates, strict=True))), one_by_one,
                               rtol=1e-5, atol=1e-6)
