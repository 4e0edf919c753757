"""Small randomly initialised models and a byte-level tokenizer, for tests.

They exercise the real GPT-2 and LLaMA code of ``transformers`` with no download.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

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


def _gpt2_config(vocab_size: int) -> GPT2Config:
    return GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=256, vocab_size=vocab_size,
                      bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)


def _llama_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=256,
                       bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1)


def _bert_config(vocab_size: int) -> BertConfig:
    return BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      vocab_size=vocab_size, max_position_embeddings=256, pad_token_id=vocab_size - 1)


def tiny_gpt2(vocab_size: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return tiny_model("tiny-gpt2", vocab_size)


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return tiny_model("tiny-llama", vocab_size)


def tiny_model(name: str, vocab_size: int, num_labels: int | None = None, regression: bool | None = None
               ) -> nn.Module:
    """``tiny-gpt2`` / ``tiny-llama`` / ``tiny-bert``; a sequence classifier when ``num_labels`` is set
    (a regressor when ``regression``, by default when ``num_labels == 1``)."""
    configs = {"tiny-gpt2": _gpt2_config, "tiny-llama": _llama_config, "tiny-bert": _bert_config}
    config = configs[name](vocab_size)
    if num_labels is None:
        if name == "tiny-bert":
            raise ValueError("tiny-bert is an encoder: give num_labels for a classifier")
        return (GPT2LMHeadModel if name == "tiny-gpt2" else LlamaForCausalLM)(config)
    config.num_labels = num_labels
    regression = num_labels == 1 if regression is None else regression
    config.problem_type = "regression" if regression else "single_label_classification"
    classes = {"tiny-gpt2": GPT2ForSequenceClassification, "tiny-llama": LlamaForSequenceClassification,
               "tiny-bert": BertForSequenceClassification}
    return classes[name](config)
