"""NF4 and int8 bases (bitsandbytes, on CPU) under every expert kind and mixing:
the base stays quantized and frozen, experts and task heads train in float."""

import pytest
import torch

from ondevice_moe.errors import UserError
from ondevice_moe.layout import ExpertSpec, Layout, RouterSpec, attach_layout
from ondevice_moe.models import load_base_model

LAYOUTS = {
    "comigs-mlp-mixture": Layout(experts=(ExpertSpec("adapter", "shared"), ExpertSpec("lora", "private")),
                                 router=RouterSpec("token-topk"), mixing="mlp", attention_lora="shared"),
    "hermes-block": Layout(experts=(ExpertSpec("lora", "shared"), ExpertSpec("adapter", "shared"),
                                    ExpertSpec("prefix", "private")), router=RouterSpec("hermes"), mixing="block"),
}


# BERT has no separable MLP, so the exact mixture is refused there (test_layout.py).
CASES = [("tiny-llama", "comigs-mlp-mixture"), ("tiny-llama", "hermes-block"), ("tiny-bert", "hermes-block")]


def _batch(num_labels):
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    if num_labels is None:
        return {"input_ids": tokens, "labels": tokens}
    return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": torch.tensor([0, 2])}


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
@pytest.mark.parametrize(("name", "layout_name"), CASES)
def test_experts_train_on_a_quantized_base(saved_tiny_models, quantization, name, layout_name):
    folder, num_labels = saved_tiny_models[name], (3 if name == "tiny-bert" else None)
    layout = LAYOUTS[layout_name]
    base = load_base_model(str(folder), "float32", quantization, num_labels).model
    quantized = [n for n, p in base.named_parameters() if p.dtype in (torch.uint8, torch.int8)]
    assert quantized, "bitsandbytes should have quantized the base's linear layers"
    heads = ("classifier", "bert.pooler") if num_labels else ()
    model = attach_layout(base, layout, seed=0, own=heads)
    for path in heads:
        model.get_submodule(path).requires_grad_(True)
    model.train()
    output = model(**_batch(num_labels))
    assert torch.isfinite(output.loss)
    output.loss.backward()
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(p.dtype == torch.float32 for p in trained.values())
    with_grad = [n for n, p in trained.items() if p.grad is not None and p.grad.abs().sum() > 0]
    assert any("lora_B" in n for n in with_grad) and any(".up" in n for n in with_grad), with_grad
    if num_labels:
        assert any(n.startswith("classifier") for n in with_grad), "the float task head must train"
    assert not any(n in quantized for n in trained), "quantized weights must stay frozen"


@pytest.mark.parametrize("name", ["tiny-llama", "mlp"])
def test_a_model_built_in_memory_is_not_silently_left_unquantized(name):
    with pytest.raises(UserError, match=r"cannot be quantized(.|\n)*save_pretrained"):
        load_base_model(name, quantization="nf4", num_labels=10, input_shape=(64,))


def test_a_quantized_base_without_bitsandbytes_names_the_extra(saved_tiny_models, monkeypatch):
    import importlib.util

    from ondevice_moe.errors import UserError

    real = importlib.util.find_spec
    missing = {"bitsandbytes"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    with pytest.raises(UserError) as error:
        load_base_model(str(saved_tiny_models["tiny-llama"]), "float32", "nf4")
    assert "model.quantization: nf4 needs bitsandbytes" in error.value.problem
    assert "ondevice-moe[quant]" in error.value.fix
