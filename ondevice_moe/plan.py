"""What a recipe will do, without training: per method, its devices and, per
device, the parameters the local procedure trains and those it sends to the
server each round; per user, the data it holds (``ondevice-moe finetune --dry-run``).

A trainable parameter is one with ``requires_grad`` that the method's local
procedure updates (:meth:`Method.is_trainable`); the upload is what the server
checks a device's upload against, as the transport sends it: exactly what a
device sends, except that methods that upload only the experts a round selected
(Hermes) send at most that many.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ondevice_moe.data.blocks import IGNORED, BlockExamples
from ondevice_moe.data.splits import SPLITS
from ondevice_moe.federation.device import build_model, federated_task, upload_reference, user_data
from ondevice_moe.federation.job import Job
from ondevice_moe.recipe import Recipe
from ondevice_moe.server_rules.transport import encode


@dataclass(frozen=True)
class DevicePlan:
    """One device's parameter counts (scalars, not tensors) and its upload per round in bytes."""

    device: int
    trainable: int
    uploaded: int
    uploaded_bytes: int


@dataclass(frozen=True)
class MethodPlan:
    """One method entry of the recipe: its resolved name and one plan per device."""

    name: str
    devices: tuple[DevicePlan, ...]

    @property
    def uploaded_bytes(self) -> int:
        """Bytes all devices send per round (an upper bound for partial uploads)."""
        return sum(device.uploaded_bytes for device in self.devices)


def plan_recipe(recipe: Recipe, run_dir: Path) -> list[MethodPlan]:
    """The plan of every method of ``recipe``, building each device's model once (base model cached)."""
    plans = []
    for index in range(len(recipe.methods)):
        job = Job(recipe, index, run_dir)
        devices = tuple(device_plan(job, device) for device in range(len(job.method.layouts)))
        plans.append(MethodPlan(job.method.name, devices))
    return plans


def device_plan(job: Job, device: int) -> DevicePlan:
    """Count the parameters device ``device`` trains, and what it uploads each round: the tensors the
    server checks its upload against (:func:`~ondevice_moe.federation.device.upload_reference`, from
    the method's one answer to what travels), in bytes as ``federation.transport`` sends them."""
    method = job.method
    trainable = sum(param.numel() for name, param in build_model(job, device).named_parameters()
                    if param.requires_grad and method.is_trainable(name))
    reference = upload_reference(job, device)
    wire = encode(reference, job.recipe.federation.transport)
    return DevicePlan(device, trainable, sum(tensor.numel() for tensor in reference.values()),
                      sum(tensor.numel() * tensor.element_size() for tensor in wire.values()))


@dataclass(frozen=True)
class TextCounts:
    """A language-modelling user's data as a run reads it, per split: blocks of ``data.context_length``,
    the real tokens in them (padding left out: an instruction fills part of its block) and the tokens the
    loss and perplexity score (``scored``: an instruction's response; every token of text)."""

    user: str
    blocks: dict[str, int]
    tokens: dict[str, int]
    scored: dict[str, int]

    @property
    def instructions(self) -> bool:
        """Whether part of the tokens go unscored (prompts): the data are instructions."""
        return self.scored != self.tokens


@dataclass(frozen=True)
class ExampleCounts:
    """A task client's data as a run deals it: examples per split (``valid`` where the task holds a
    validation split) and, for classification, how many training examples carry each label (``None``
    for regression scores)."""

    user: str
    examples: dict[str, int]
    labels: dict[str, int] | None


UserCounts = TextCounts | ExampleCounts


def data_counts(job: Job) -> list[UserCounts]:
    """Read every user's data as the run will (the same loaders, so the same errors: a missing file,
    a wrong ``text_field``) and count what each holds."""
    recipe = job.recipe
    if recipe.task is None:
        counts: list[UserCounts] = []
        for index, user in enumerate(recipe.user_names):
            data = user_data(job, index)
            examples = {split: data.examples(split) for split in SPLITS}
            counts.append(TextCounts(user, {split: len(held) for split, held in examples.items()},
                                     {split: int(held.mask.sum()) for split, held in examples.items()},
                                     {split: _scored_tokens(held) for split, held in examples.items()}))
        return counts
    task = federated_task(job)
    spec = task.task
    valid = task.valid or [None] * len(task.train)
    return [ExampleCounts(user, _split_sizes(train, test, held),
                          None if spec.is_regression else _label_counts(train.labels.tolist(), spec.label_names))
            for user, train, test, held in zip(recipe.user_names, task.train, task.test, valid, strict=True)]


def _split_sizes(train: object, test: object, valid: object | None) -> dict[str, int]:
    """Examples per split; ``valid`` where the task holds a validation split, even an empty one."""
    return {"train": len(train), "test": len(test)} | ({} if valid is None else {"valid": len(valid)})


def _scored_tokens(examples: BlockExamples) -> int:
    """Tokens the loss reads: each real token for text (the first of a block is context only, but a
    block of text counts whole, as ``tokens``), an instruction's labelled response tokens."""
    if examples.labels is None:
        return int(examples.mask.sum())
    return int((examples.labels != IGNORED).sum())


def _label_counts(labels: list[float], names: tuple[str, ...]) -> dict[str, int]:
    """Examples per class name, in the task's class order."""
    counts = Counter(int(label) for label in labels)
    return {names[index]: counts[index] for index in sorted(counts)}


__all__ = ["DevicePlan", "ExampleCounts", "MethodPlan", "TextCounts", "UserCounts", "data_counts", "device_plan",
           "plan_recipe"]
