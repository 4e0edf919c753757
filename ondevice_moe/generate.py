"""Text from one user's trained model (``ondevice-moe generate``).

The model is the one ``export`` and ``inspect`` open: the user's device's base model with its
experts and routers attached and its checkpoint loaded. It continues the prompt through
transformers' ``generate``: greedy at temperature 0, else sampled from ``softmax(logits / T)``
cut to the ``top_k`` most likely tokens and the nucleus of mass ``top_p`` (transformers' names;
0 and 1.0 cut nothing), from ``seed``.

**The key/value cache.** A causal model's hidden state of a token reads only the tokens before it,
so a router that routes each token on its own hidden state (CoMiGS, Hermes, FedAvg's LoRA), a
client-level mixture, and a prefix expert (its keys and values prepended in the attention function,
whatever the cache holds) give the same logits with the cache as without. A module whose output for
a token reads the *whole* text through another path says so with ``reads_whole_context = True``
(Flow's per-instance router, a running mean of the sequence's embeddings); a model holding one is
run on the whole text at every step instead, as in training and in ``eval``.

**Precision.** The experts' low-rank products run in float32, as PEFT runs adapters on a
half-precision base; training and ``eval`` run them in the base's dtype
(:mod:`~ondevice_moe.experts.precision`). On a float32 base the two are the same.

**Instruction runs.** A run whose users' data are prompts and responses (an instruction source,
:data:`~ondevice_moe.data.sources.INSTRUCTION_SOURCES`) trained through the tokenizer's chat template
(:mod:`~ondevice_moe.data.instruction_blocks`); its prompt is the template applied to one user
message with the assistant's header added, unless ``raw``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers.generation.streamers import TextStreamer

from ondevice_moe.data.sources import INSTRUCTION_SOURCES
from ondevice_moe.errors import UserError
from ondevice_moe.experts.precision import products_in
from ondevice_moe.federation.device import job_base_model
from ondevice_moe.models.devices import model_device
from ondevice_moe.recipe import Recipe
from ondevice_moe.run_model import open_user_model
from ondevice_moe.runner import finished_jobs


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen, as transformers names it: greedy at ``temperature`` 0."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if not self.temperature >= 0:  # also NaN
            raise UserError(f"--temperature {self.temperature} is negative",
                            "use 0 (greedy) or a positive temperature")
        if self.top_k < 0:
            raise UserError(f"--top-k {self.top_k} is negative", "use 0 (no cut) or a positive count")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p {self.top_p} is not in (0, 1]", "use 1.0 (no cut) or a smaller mass")

    def options(self) -> dict[str, object]:
        """``generate``'s keyword options."""
        if self.temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


@dataclass(frozen=True)
class Generation:
    """A prompt and the model's continuation of it (``new_tokens`` tokens, fewer where it ended the text).

    ``templated``: the prompt went through the chat template; ``cached``: decoding kept a key/value cache."""

    prompt: str
    continuation: str
    new_tokens: int
    templated: bool = False
    cached: bool = True


def generate_text(run_dir: Path, method: str, user: str, prompt: str, max_new_tokens: int = 50,
                  temperature: float = 0.0, seed: int = 0, device: str | None = None, *, top_k: int = 0,
                  top_p: float = 1.0, raw: bool = False, on_text: Callable[[str], None] | None = None) -> Generation:
    """Continue ``prompt`` with ``user``'s trained model of ``method`` in ``run_dir`` (``device``
    overrides the run's ``model.device``). ``raw`` skips an instruction run's chat template;
    ``on_text`` receives the continuation piece by piece as it is written (streaming).

    A classification run, bad settings, or a prompt that leaves no room in the model's context are a
    :class:`UserError`, raised before the model loads where they can be."""
    sampling = Sampling(temperature, top_k, top_p, seed)
    _check_settings(prompt, max_new_tokens)
    sampling.check()
    recipe, _ = finished_jobs(Path(run_dir), device)
    if not recipe.is_language_modelling:
        raise UserError(f"{run_dir} is a classification run (task {recipe.task.name}): its models label text, "
                        "they do not write it",
                        f"generate from a language-modelling run, or score labelled text with "
                        f"`ondevice-moe eval {run_dir} --data FILE`")
    opened = open_user_model(Path(run_dir), method, user, device)
    tokenizer = job_base_model(opened.job).tokenizer
    templated = not raw and tunes_instructions(recipe) and bool(getattr(tokenizer, "chat_template", None))
    prompt_ids = prompt_tokens(tokenizer, prompt, templated)
    _check_context(opened.model, prompt_ids.shape[1], max_new_tokens)
    cached = uses_cache(opened.model)
    new = generate_tokens(opened.model, prompt_ids, max_new_tokens, sampling, _pad_id(tokenizer),
                          _streamer(tokenizer, on_text), use_cache=cached)
    return Generation(prompt, tokenizer.decode(new, skip_special_tokens=True), int(new.numel()), templated, cached)


def tunes_instructions(recipe: Recipe) -> bool:
    """Whether any user's data are prompts and responses (trained through the chat template)."""
    return recipe.data is not None and any(source.source in INSTRUCTION_SOURCES
                                           for user in recipe.data.users for source in user.sources)


def prompt_tokens(tokenizer, prompt: str, templated: bool) -> torch.Tensor:
    """The prompt's token ids, shape ``(1, n)``: through the chat template as one user turn and the
    assistant's header (as :func:`~ondevice_moe.data.instruction_blocks.tokenize` trained it), or as is."""
    if templated:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]


def uses_cache(model: nn.Module) -> bool:
    """Whether decoding may keep a key/value cache: no module reads the whole text (module docstring)."""
    return not any(getattr(module, "reads_whole_context", False) for module in model.modules())


def generate_tokens(model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, sampling: Sampling,
                    pad_id: int | None, streamer: TextStreamer | None = None, use_cache: bool | None = None,
                    **options: object) -> torch.Tensor:
    """The new token ids after ``prompt_ids`` (``use_cache``: default :func:`uses_cache`; ``options``: more of
    ``generate``'s, e.g. ``min_new_tokens``)."""
    where = model_device(model)
    cache = uses_cache(model) if use_cache is None else use_cache
    with torch.random.fork_rng(devices=[where] if where.type == "cuda" else []), torch.no_grad(), \
            products_in(torch.float32):
        torch.manual_seed(sampling.seed)
        output = model.generate(prompt_ids.to(where), attention_mask=torch.ones_like(prompt_ids).to(where),
                                max_new_tokens=max_new_tokens, use_cache=cache, pad_token_id=pad_id,
                                streamer=streamer, **sampling.options(), **options)
    return output[0, prompt_ids.shape[1]:].cpu()


class _CallbackStreamer(TextStreamer):
    """transformers' streamer, handing each finished piece of text to a callback instead of ``print``."""

    def __init__(self, tokenizer, on_text: Callable[[str], None]) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.on_text = on_text

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.on_text(text)


def _streamer(tokenizer, on_text: Callable[[str], None] | None) -> TextStreamer | None:
    return None if on_text is None else _CallbackStreamer(tokenizer, on_text)


def _pad_id(tokenizer) -> int | None:
    """The tokenizer's padding token, else its end of text (one prompt pads nothing; ``generate`` wants one)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _check_settings(prompt: str, max_new_tokens: int) -> None:
    if not prompt:
        raise UserError("the prompt is empty", "give the text to continue with --prompt")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens} is not positive", "ask for at least one token")


def _check_context(model: torch.nn.Module, prompt_tokens: int, max_new_tokens: int) -> None:
    """The prompt and the new tokens must fit the model's positions."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        raise UserError(f"the prompt ({prompt_tokens} tokens) and {max_new_tokens} new tokens exceed the model's "
                        f"{limit} positions", "shorten the prompt or lower --max-new-tokens")


__all__ = ["Generation", "Sampling", "generate_text", "generate_tokens", "prompt_tokens", "tunes_instructions",
           "uses_cache"]
