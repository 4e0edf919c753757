"""Text from one user's trained model (``ondevice-moe generate``).

The model is the one ``export`` and ``inspect`` open: the user's device's base model with its
experts and routers attached and its checkpoint loaded. It continues the prompt through
transformers' ``generate``: greedy at temperature 0, else sampled from ``softmax(logits / T)``
over the whole vocabulary (no top-k or top-p cut), from ``seed``.

Every step runs the model on the whole text so far (no key/value cache): the routers and experts
then see each token in its full context, as in training and in ``eval``, whatever a method routes
on (a token, a block, a whole instance).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ondevice_moe.errors import UserError
from ondevice_moe.federation.device import job_base_model
from ondevice_moe.models.devices import model_device
from ondevice_moe.run_model import open_user_model
from ondevice_moe.runner import finished_jobs


@dataclass(frozen=True)
class Generation:
    """A prompt and the model's continuation of it (``new_tokens`` tokens, fewer where it ended the text)."""

    prompt: str
    continuation: str
    new_tokens: int


def generate_text(run_dir: Path, method: str, user: str, prompt: str, max_new_tokens: int = 50,
                  temperature: float = 0.0, seed: int = 0, device: str | None = None) -> Generation:
    """Continue ``prompt`` with ``user``'s trained model of ``method`` in ``run_dir`` (``device``
    overrides the run's ``model.device``). A classification run, bad settings, or a prompt that
    leaves no room in the model's context are a :class:`UserError`, raised before the model loads
    where they can be."""
    _check_settings(prompt, max_new_tokens, temperature)
    recipe, _ = finished_jobs(Path(run_dir), device)
    if not recipe.is_language_modelling:
        raise UserError(f"{run_dir} is a classification run (task {recipe.task.name}): its models label text, "
                        "they do not write it",
                        f"generate from a language-modelling run, or score labelled text with "
                        f"`ondevice-moe eval {run_dir} --data FILE`")
    opened = open_user_model(Path(run_dir), method, user, device)
    model = opened.model
    tokenizer = job_base_model(opened.job).tokenizer
    prompt_ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    _check_context(model, prompt_ids.shape[1], max_new_tokens)
    where = model_device(model)
    sampled = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
        else {"do_sample": False}
    with torch.random.fork_rng(devices=[where] if where.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(seed)
        output = model.generate(prompt_ids.to(where), attention_mask=torch.ones_like(prompt_ids).to(where),
                                max_new_tokens=max_new_tokens, use_cache=False,
                                pad_token_id=_pad_id(tokenizer), **sampled)
    new = output[0, prompt_ids.shape[1]:].cpu()
    return Generation(prompt, tokenizer.decode(new, skip_special_tokens=True), int(new.numel()))


def _pad_id(tokenizer) -> int | None:
    """The tokenizer's padding token, else its end of text (one prompt pads nothing; ``generate`` wants one)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _check_settings(prompt: str, max_new_tokens: int, temperature: float) -> None:
    if not prompt:
        raise UserError("the prompt is empty", "give the text to continue with --prompt")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens} is not positive", "ask for at least one token")
    if not temperature >= 0:  # also NaN
        raise UserError(f"--temperature {temperature} is negative", "use 0 (greedy) or a positive temperature")


def _check_context(model: torch.nn.Module, prompt_tokens: int, max_new_tokens: int) -> None:
    """The prompt and the new tokens must fit the model's positions."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        raise UserError(f"the prompt ({prompt_tokens} tokens) and {max_new_tokens} new tokens exceed the model's "
                        f"{limit} positions", "shorten the prompt or lower --max-new-tokens")


__all__ = ["Generation", "generate_text"]
