"""Figures over several runs (seeds) of one recipe, as ``ondevice-moe compare`` prints them."""

from __future__ import annotations

import statistics
from typing import Any

from ondevice_moe.report.summary import DIVERGED


def spread(values: list[float | None]) -> str:
    """Mean (std) over runs; ``diverged`` when a run has no finite figure."""
    if any(value is None for value in values):
        return DIVERGED
    deviation = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{number(statistics.fmean(values))} ({number(deviation)})"


def number(value: float, sign: str = "") -> str:
    """Two decimals, or three significant digits for values that two decimals would show as zero
    (the near-zero test losses of FLoRAL's synthetic tasks)."""
    return f"{value:{sign}.2e}" if value != 0 and abs(value) < 0.005 else f"{value:{sign}.2f}"


def common_methods(summaries: list[dict[str, Any]]) -> list[str]:
    """The methods every run's summary holds, in the first run's order."""
    return [m for m in summaries[0]["methods"] if all(m in s["methods"] for s in summaries)]


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
