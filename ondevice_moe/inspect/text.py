"""What a page routes: the user's text or file, or the start of the user's own test split
(its first instances, for Flow's per-instance policy)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.run_model import UserModel

INSTANCES = 32  # Flow: how many of the user's test instances the page routes


@dataclass(frozen=True)
class PageText:
    """Token ids, each token as text, and a sentence saying where they came from."""

    input_ids: torch.Tensor
    tokens: list[str]
    source: str


def page_text(opened: UserModel, text: str | None, source: str = "your text") -> PageText:
    """``text`` tokenized as the run tokenized its data (cut to the run's context), or, when
    ``text`` is ``None``, the first test block (language modelling) or test example
    (classification) of the user. A small-model task has no text: a :class:`UserError`."""
    recipe, job = opened.recipe, opened.job
    if recipe.task is not None and not recipe.task.spec().is_text:
        raise UserError(f"run '{recipe.name}' is a {recipe.task.name} task without text: there are no tokens to colour",
                        "inspect a language-modelling or text-classification run")
    tokenizer = dev.job_base_model(job).tokenizer
    limit = recipe.data.context_length if recipe.is_language_modelling else recipe.task.max_length
    user = recipe.user_names.index(opened.user)
    if text is None:
        if recipe.is_language_modelling:
            ids = dev.user_data(job, user).test[0]
            what = f"the first test block of user {opened.user} ({len(ids)} tokens)"
        else:
            examples = dev.federated_task(job).test[user]
            ids = examples.input_ids[0][examples.attention_mask[0].bool()]
            what = f"the first test example of user {opened.user} ({len(ids)} tokens)"
        return PageText(ids, _pieces(tokenizer, ids), f"No text given: {what}.")
    if not text.strip():
        raise UserError(f"{source} is empty", "pass some text with --text \"...\" or a non-empty --file")
    encoded = tokenizer(text, add_special_tokens=not recipe.is_language_modelling)["input_ids"]
    ids = torch.tensor(encoded[:limit], dtype=torch.long)
    cut = f", cut to the run's {limit}-token context" if len(encoded) > limit else ""
    return PageText(ids, _pieces(tokenizer, ids), f"{source[:1].upper()}{source[1:]} ({len(ids)} tokens{cut}).")


def _pieces(tokenizer, ids: torch.Tensor) -> list[str]:
    """Each token's share of the decoded text, so the pieces read as the text does (WordPiece's
    spaces between words included); a token whose share is not a clean suffix (part of a
    multi-byte character) is decoded on its own."""
    pieces, before = [], ""
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:end].tolist())
        pieces.append(text[len(before):] if text.startswith(before) else tokenizer.decode([int(ids[end - 1])]))
        before = text
    return pieces


def page_instances(opened: UserModel) -> tuple[dict[str, torch.Tensor], list[str], str]:
    """The user's first test instances as model inputs, a label for each, and a sentence
    saying so: a small task's inputs and classes, a text task's examples and classes, or a
    language model's test blocks."""
    job, user = opened.job, opened.recipe.user_names.index(opened.user)
    if opened.recipe.is_language_modelling:
        blocks = dev.eval_blocks(job, user)[:INSTANCES]
        return ({"input_ids": blocks}, [f"block {i}" for i in range(len(blocks))],
                f"The first {len(blocks)} test blocks of user {opened.user}.")
    examples = dev.federated_task(job).test[user]
    rows = torch.arange(min(INSTANCES, len(examples)))
    batch = {key: value for key, value in examples.batch(rows).items() if key != "labels"}
    labels = [f"y={int(y)}" for y in examples.labels[rows]]
    return batch, labels, f"The first {len(labels)} test instances of user {opened.user}."
