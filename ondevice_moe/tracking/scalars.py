"""The numbers of a ``metrics.jsonl`` record as tracker scalars: a tag, a step and a value.

Every record with a ``round`` gives each of its numbers as ``<kind>/<key>`` at that round, with
``/<user>`` for a user's own figures (``train/train_loss/code``, ``eval/test_ppl_in/code``,
``comm/bytes_up``, ``round/wall_s``). A ``train`` record's ``step_losses``, ``step_lrs`` and
``step_grad_norms`` give ``step/train_loss/<user>``, ``step/lr/<user>`` and ``step/grad_norm/<user>`` at
each step of the device's own count (:func:`~ondevice_moe.report.step_series`).
What names a record (method, kind, round, user, device, node) is not a scalar; neither is text, a
flag or a list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ondevice_moe.report import step_series

STEP_SERIES = {"step_losses": "train_loss", "step_lrs": "lr", "step_grad_norms": "grad_norm"}  # key → curve
NAMING_KEYS = frozenset({"method", "kind", "round", "user", "device", "node", "old_node"})
# MLflow takes letters, digits and _ - . space : / in a metric's name; a user's name may hold a '+'.
_NOT_IN_A_TAG = re.compile(r"[^\w.\- :/]")


@dataclass(frozen=True)
class Scalar:
    """One point of one curve."""

    tag: str
    step: int
    value: float


def scalars(record: dict[str, Any], every_step: bool) -> list[Scalar]:
    """The record's scalars (none for a record without a round: ``done``, ``error``, ``refused``)."""
    if "round" not in record:
        return []
    user = record.get("user")
    points = [Scalar(tag(record["kind"], key, user), record["round"], float(value))
              for key, value in sorted(record.items()) if key not in NAMING_KEYS and is_number(value)]
    if every_step and record["kind"] == "train":
        points += [Scalar(tag("step", name, user), step, value)
                   for key, name in STEP_SERIES.items() for step, value in step_series(record, key)]
    return points


def tag(group: str, key: str, user: str | None) -> str:
    """``group/key`` or ``group/key/user``, with characters a tracker refuses as ``_``."""
    return _NOT_IN_A_TAG.sub("_", f"{group}/{key}" if user is None else f"{group}/{key}/{user}")


def is_number(value: Any) -> bool:
    """An int or a float, not a bool (JSON's ``true`` is no figure)."""
    return isinstance(value, int | float) and not isinstance(value, bool)
