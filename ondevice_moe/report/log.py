"""``metrics.jsonl``: the append-only log of a run's records, and the per-step series a ``train`` record holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ondevice_moe.safe_files import append_handle, write_text


class CorruptLog(ValueError):
    """``metrics.jsonl`` holds something other than JSON records (not just a line cut short)."""


class MetricsLog:
    """Append-only JSON-lines log; each record is one flat dict with a ``kind``.

    A run killed mid-write can leave its last line cut short (no newline):
    :meth:`read` ignores it and :meth:`repair` removes it. Anything else that
    is not a record raises :class:`CorruptLog`.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with append_handle(self.path) as handle:  # never through a link planted in its place
            handle.write(json.dumps(record, sort_keys=True) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        if not self.path.is_file():  # a FIFO would block the reader, a folder cannot be read
            raise CorruptLog(f"{self.path} is not a regular file")
        try:
            lines = self.path.read_text(encoding="utf-8").split("\n")
        except UnicodeDecodeError as error:
            raise CorruptLog(f"{self.path} is not text ({error})") from None
        records = []
        for number, line in enumerate(lines[:-1], start=1):  # lines[-1]: empty, or a line cut short
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past any record's depth
                record = None
            if not (isinstance(record, dict) and isinstance(record.get("kind"), str)
                    and isinstance(record.get("method"), str)):
                raise CorruptLog(f"{self.path} line {number} is not a metrics record (each names its kind and "
                                 f"method): {line[:60]!r}")
            records.append(record)
        return records

    def repair(self) -> None:
        """Drop a last line cut short by a killed run, so appends start on a fresh line."""
        if not self.path.exists():
            return
        text = self.path.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):
            self._replace(text[: text.rfind("\n") + 1])

    def discard(self, method: str) -> None:
        """Remove every record of ``method`` (an interrupted attempt), atomically."""
        kept = [r for r in self.read() if r.get("method") != method]
        self._replace("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def discard_after(self, method: str, server_round: int) -> None:
        """Remove ``method``'s records of the rounds after ``server_round`` and its ``error`` records (an
        attempt cut short, which a continued run replaces), atomically."""
        def later(record: dict[str, Any]) -> bool:
            stamped = isinstance(record.get("round"), int) and record["round"] > server_round
            return record.get("method") == method and (stamped or record["kind"] == "error")

        self._replace("".join(json.dumps(r, sort_keys=True) + "\n" for r in self.read() if not later(r)))

    def finished(self) -> set[str]:
        """Methods whose ``done`` record (written after the final checkpoints) is in the log."""
        return {r["method"] for r in self.read() if r["kind"] == "done"}

    def _replace(self, text: str) -> None:
        write_text(self.path, text)


def step_losses(record: dict[str, Any]) -> list[tuple[int, float]]:
    """A ``train`` record's loss at each training step, as ``(step, loss)`` (:func:`step_series`)."""
    return step_series(record, "step_losses")


def step_series(record: dict[str, Any], key: str) -> list[tuple[int, float]]:
    """A ``train`` record's list ``key`` (``step_losses``, ``step_lrs``, ``step_grad_norms``) as ``(step,
    value)``: steps of the device's own count, which runs on across rounds (the record's ``iteration`` is
    its round's last step). None where the record does not say which steps they were (a device's malformed
    metrics)."""
    values, last = record.get(key), record.get("iteration")
    if not (isinstance(values, list) and isinstance(last, int | float) and values and len(values) <= last < 2**53):
        return []
    first = int(last) - len(values) + 1
    return [(first + offset, float(value)) for offset, value in enumerate(values)]
