"""Small randomly initialised models and a byte-level tokenizer, for tests.

They exercise the real GPT-2 and LLaMA code of ``transformers`` with no download.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 257-token byte-level tokenizer (256 bytes + end-of-text)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    vocab[EOS] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, pad_token=EOS)


def tiny_gpt2(vocab_size: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=256, vocab_size=vocab_size,
        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1,
    )
    return GPT2LMHeadModel(config)


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256,
        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1,
    )
    return LlamaForCausalLM(config)
