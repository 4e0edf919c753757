"""Dependencies' messages a user cannot act on are silenced when the package loads, and only those."""

import os
import subprocess
import sys

import pytest

LOAD = """
{first}
import bitsandbytes, warnings
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj"]))
warnings.warn("a warning about the user's own run", UserWarning)
"""


def _stderr(first: str) -> str:
    result = subprocess.run([sys.executable, "-W", "always", "-c", LOAD.format(first=first)], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    return result.stderr


def _has_avx512_bf16() -> bool:
    """Whether bitsandbytes' CPU backend tries the hub kernel here."""
    return "avx512_bf16" in open("/proc/cpuinfo").read()


@pytest.mark.slow
def test_loading_a_model_and_an_adapter_prints_only_what_concerns_the_user():
    unsilenced = _stderr("")
    assert "is_gradient_checkpointing" in unsilenced  # the noise is there without the package's filters
    assert ("No module named 'kernels'" in unsilenced) == _has_avx512_bf16()  # bitsandbytes logs it on such CPUs
    quiet = _stderr("import ondevice_moe")
    assert "is_gradient_checkpointing" not in quiet and "No module named 'kernels'" not in quiet
    assert "script_method" not in quiet
    assert "a warning about the user's own run" in quiet
