"""A base loaded in bf16 is what transformers' own bf16 load gives: the weights in bf16, RoPE's
``inv_freq`` (computed, never saved) left in float32."""

import torch
from transformers import AutoModelForCausalLM

from ondevice_moe.models import load_base_model


def _stock_bf16(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def test_a_bf16_base_from_a_folder_gives_the_stock_bf16_logits(saved_tiny_models, tokens):
    folder = saved_tiny_models["tiny-llama"]
    ours = load_base_model(str(folder), dtype="bfloat16").model
    stock = _stock_bf16(folder)
    rotary = ours.model.rotary_emb
    assert ours.lm_head.weight.dtype == torch.bfloat16
    assert rotary.inv_freq.dtype == rotary.original_inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, stock.model.rotary_emb.inv_freq)
    with torch.no_grad():
        assert torch.equal(ours(tokens).logits, stock(tokens).logits)


def test_a_model_built_in_memory_and_cast_to_bf16_matches_its_saved_copy(tmp_path, tokens):
    load_base_model("tiny-llama").model.save_pretrained(tmp_path)
    ours = load_base_model("tiny-llama", dtype="bfloat16").model
    with torch.no_grad():
        assert torch.equal(ours(tokens).logits, _stock_bf16(tmp_path)(tokens).logits)
