"""A finished run's trained users scored on a file of the user's (``ondevice-moe eval RUN --data FILE``).

A language-modelling run reads whatever its training reads from a user's own files (the ``files``
source): a ``.txt`` / ``.md`` file (one document), a CSV, TSV, JSON-lines or Parquet file (one document
per row, from the column ``text_column``), a folder or glob of them, or a ``save_to_disk`` folder. The
documents are tokenized as training tokenized its data (each followed by the end-of-text token) and
cut into blocks of the run's ``data.context_length``; each method's model of each user gets the
perplexity of those blocks and the standard error of their mean NLL.

A file of prompts and responses (columns ``prompt_column`` and ``response_column``, or chat messages
in ``messages_column``; the ``instruction-file`` source's formats) is scored as instruction training
scored its test split: one block per instruction through the tokenizer's chat template where it has
one, the perplexity of the *responses'* tokens only (:mod:`~ondevice_moe.data.instruction_blocks`).
Naming a prompt, response or messages column asks for it; so does a run that tuned instructions
(:func:`~ondevice_moe.generate.tunes_instructions`) when no ``text_column`` is named and the file is
not plain text.

A classification run reads labelled examples: a ``.csv`` / ``.tsv`` / ``.jsonl`` file with text
column(s) and a label column (the class names of the run's task, or class indices), checked as a
recipe's own task file is, tokenized to the run's ``task.max_length``; each user's model gets the
task's metric (×100 for fractions, as in the run's report). Under ``task.clusters`` client ``k`` is
scored against the labels its cluster learned, ``(y + k mod C) mod L``.

Every user is scored with its device's own checkpoint, the model ``export`` and ``generate`` open:
a method whose test is more than that model (Flow's adapted test, FedEM's mixture of the centres)
is scored here on the model alone. The scores go to ``eval.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ondevice_moe.data.blocks import IGNORED, BlockExamples
from ondevice_moe.data.classification import ClientExamples
from ondevice_moe.data.instruction_blocks import instruction_blocks
from ondevice_moe.data.sources import documents
from ondevice_moe.data.splits import to_blocks
from ondevice_moe.data.tasks import UserTaskFile, load_task, user_task
from ondevice_moe.destination import check_file_destination
from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.evaluation import reported
from ondevice_moe.federation.job import Job
from ondevice_moe.generate import tunes_instructions
from ondevice_moe.likelihood import score_blocks
from ondevice_moe.metrics import lower_is_better, task_score
from ondevice_moe.models.gguf_cache import file_sha256
from ondevice_moe.recipe import Recipe
from ondevice_moe.run_folder import RunFolder
from ondevice_moe.run_model import trained_model
from ondevice_moe.runner import finished_jobs
from ondevice_moe.training import predict

EVAL_FILE = "eval.json"
TEXT_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True)
class FileScores:
    """What ``eval --data`` measured: per method, per user, the metric (and, for perplexity, the NLL's
    standard error); ``size`` says how much of the file was scored (blocks and tokens, or examples)."""

    metric: str
    size: dict[str, int]
    scores: dict[str, dict[str, dict[str, float | None]]]
    written: Path
    still_training: list[str]  # methods a live run is training still: not scored


@dataclass(frozen=True)
class InstructionColumns:
    """Where a file of instructions keeps its prompts and responses (or whole chat conversations)."""

    prompt: str = "prompt"
    response: str = "response"
    messages: str | None = None


def score_file(run_dir: Path, data: Path, out: Path | None = None, device: str | None = None,
               text_columns: list[str] | None = None, label_column: str | None = None,
               instructions: InstructionColumns | None = None) -> FileScores:
    """Score every finished method's model of every user of ``run_dir`` on ``data`` and write
    ``eval.json`` (into the run folder, or ``out``). ``text_columns`` / ``label_column`` name the
    file's columns (JSONL fields); by default ``text`` and ``label``, or the run's own task file's.
    ``instructions``: score the file's responses to its prompts (see the module's docstring).
    Bad input is a :class:`UserError`, raised before anything is written."""
    run_dir, data = Path(run_dir), Path(data)
    out = Path(out) if out is not None else run_dir / EVAL_FILE
    check_file_destination(out, "--out", EVAL_FILE)
    recipe, jobs = finished_jobs(run_dir, device)
    _check_data_path(data)
    job = jobs[0]
    if recipe.is_language_modelling:
        if text_columns is not None and (len(text_columns) != 1 or instructions is not None):
            raise UserError("a language-modelling run reads one text column, or prompts and responses",
                            "pass --text-column once, or the prompt/response (or messages) columns alone")
        if instructions is None and text_columns is None and tunes_instructions(recipe) and not _plain_text(data):
            instructions = InstructionColumns()
        if instructions is not None:
            examples = _instruction_blocks(job, data, instructions)
            metric, size = "perplexity", {"instructions": len(examples),
                                          "response_tokens": int((examples.targets != IGNORED).sum())}
        else:
            examples = _text_blocks(job, data, (text_columns or ["text"])[0])
            metric, size = "perplexity", {"blocks": int(examples.shape[0]), "tokens": int(examples.numel())}
    elif instructions is not None:
        raise UserError("prompt and response columns describe an instruction file; this run classifies text",
                        "pass --text-column and --label-column for labelled examples")
    else:
        examples = _labelled_examples(job, data, text_columns, label_column)
        metric, size = recipe.task.spec().metric, {"examples": len(examples)}
    scores = {one.method.name: _method_scores(one, recipe, examples) for one in jobs}
    record = {"run": str(run_dir), "data": str(data), "sha256": file_sha256(data) if data.is_file() else None,
              "metric": metric, "lower_is_better": lower_is_better(metric), **size, "users": recipe.user_names,
              "methods": scores}
    try:
        out.write_text(json.dumps(record, indent=2), encoding="utf-8")
    except OSError as error:
        raise UserError(f"cannot write {out} ({error.strerror or error})", "choose another --out") from None
    return FileScores(metric, size, scores, out, RunFolder(recipe, run_dir).still_training())


MAX_DATA_BYTES = 256 * 2**20  # --data is read and tokenized whole: a larger file is a mistake on one machine


def _check_data_path(data: Path) -> None:
    if not data.exists():
        raise UserError(f"--data {data} does not exist", "pass a file (or, for text, a folder) of your own")
    if not (data.is_file() or data.is_dir()):  # a FIFO or device would block the read
        raise UserError(f"--data {data} is not a regular file or folder", "pass your data file")
    size = data.stat().st_size if data.is_file() else sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
    if size > MAX_DATA_BYTES:
        raise UserError(f"--data {data} holds {size / 2**20:.0f} MiB; eval reads at most {MAX_DATA_BYTES // 2**20} MiB",
                        "score a sample of it (a few MiB of text resolve a perplexity to the second decimal)")


def _plain_text(data: Path) -> bool:
    """A text file, or a folder holding text files only (read as documents, not rows)."""
    if data.is_dir():
        files = [file for file in data.rglob("*") if file.is_file() and not file.name.startswith(".")]
        return bool(files) and all(file.suffix.lower() in TEXT_SUFFIXES for file in files)
    return data.suffix.lower() in TEXT_SUFFIXES


def _instruction_blocks(job: Job, data: Path, columns: InstructionColumns) -> BlockExamples:
    """One block per instruction of the file, labelled on its response (as training labelled them)."""
    found = list(documents("instruction-file", {"path": str(data), "prompt_field": columns.prompt,
                                                "response_field": columns.response,
                                                "messages_field": columns.messages}))
    if not found:
        raise UserError(f"--data {data} holds no instruction", "give it rows of prompts and responses")
    return instruction_blocks(found, dev.job_base_model(job).tokenizer, job.recipe.data.context_length)


def _text_blocks(job: Job, data: Path, column: str) -> torch.Tensor:
    """The file's (or folder's) documents as blocks of the run's context length."""
    texts = [_read_text(data)] if data.is_file() and data.suffix.lower() in TEXT_SUFFIXES else \
        list(documents("files", {"path": str(data), "text_field": column}))
    tokenizer = dev.job_base_model(job).tokenizer
    stream = [token for text in texts if text.strip()
              for token in (*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id)]
    context_length = job.recipe.data.context_length
    blocks = to_blocks(stream, context_length)
    if blocks.shape[0] == 0:
        raise UserError(f"--data {data} holds {len(stream)} tokens, fewer than one block of the run's "
                        f"data.context_length={context_length}", "give a longer text")
    return blocks


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read {path} ({error})", "make it a readable UTF-8 text file") from None


def _labelled_examples(job: Job, data: Path, text_columns: list[str] | None, label_column: str | None
                       ) -> ClientExamples:
    """Every row of the file, checked against the run's classes and tokenized as the run's task."""
    section = job.recipe.task
    spec = section.spec()
    if spec.is_regression or not spec.is_text:
        raise UserError(f"eval --data scores text classification; this run's task '{spec.name}' is "
                        f"{'a regression' if spec.is_regression else 'not a text task'}",
                        f"score the run on its own data: ondevice-moe eval {job.run_dir}")
    if data.is_dir():
        raise UserError(f"--data {data} is a folder", "pass one .csv, .tsv or .jsonl file of labelled examples")
    file = UserTaskFile(data, tuple(text_columns or section.text_columns), label_column or section.label_column)
    task = user_task(spec.name, spec.label_names, file, spec.metric)
    rows = [load_task(task, split) for split in ("train", "test")]  # the two halves of a fixed split: every row
    texts = [text for part in rows for text in part.texts]
    labels = [label for part in rows for label in part.labels]
    encoded = dev.job_base_model(job).tokenizer(*zip(*texts, strict=True), truncation=True,
                                                max_length=section.max_length, padding="max_length",
                                                return_tensors="pt")
    return ClientExamples(encoded["input_ids"], encoded["attention_mask"], torch.tensor(labels, dtype=torch.long))


def _method_scores(job: Job, recipe: Recipe, examples: Any) -> dict[str, dict[str, float | None]]:
    """Per user, the score of its device's model of ``job``'s method on ``examples``."""
    devices = [job.node.partition_id] if job.on_device else range(len(job.method.layouts))
    scores = {}
    for device in devices:
        model = trained_model(job, device)
        if recipe.is_language_modelling:  # the centralized upper bound: one model for every user
            score = _perplexity(model, examples, recipe.data.eval_batch_size)
            scores.update({recipe.user_names[user]: score for user in dev.users_of_device(job, device)})
        else:
            scores[recipe.user_names[device]] = _task_score(model, examples, recipe, device)
    return scores


def _perplexity(model: nn.Module, blocks: torch.Tensor | BlockExamples, batch_size: int
                ) -> dict[str, float | None]:
    """exp of the mean NLL over the scored tokens, and the standard error of the blocks' mean NLL."""
    losses = score_blocks(model, blocks, batch_size)
    return {"perplexity": losses.perplexity(), "nll_se": losses.standard_error()}


def _task_score(model: nn.Module, examples: ClientExamples, recipe: Recipe, client: int) -> dict[str, float | None]:
    """The task metric of client ``client``'s model; under ``task.clusters`` against its cluster's shifted labels."""
    spec = recipe.task.spec()
    shift = client % recipe.task.clusters if recipe.task.clusters else 0
    labels = (examples.labels + shift) % spec.num_labels
    predictions = predict(model, examples, recipe.task.eval_batch_size, regression=False)
    return {spec.metric: reported(spec.metric, task_score(spec.metric, predictions.numpy(), labels.numpy()))}


__all__ = ["EVAL_FILE", "FileScores", "InstructionColumns", "score_file"]
