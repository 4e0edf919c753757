"""The progress lines ``ondevice-moe finetune`` prints where its output is no terminal (a log file, CI).

A terminal gets rich's live bars; anywhere else a line as each method starts and a line per
round as it ends, each with the time since the run started and, while rounds remain, an estimate
of the method's time left: its mean time per round so far, times the rounds to go.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta


class ProgressLines:
    """Formats the lines of one run; ``clock`` gives seconds (monotonic)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.method_started = self.started
        self.method_name = ""

    def method(self, name: str, index: int, count: int) -> str:
        """The line of method ``index`` (0-based) of ``count`` starting."""
        self.method_started = self.clock()
        self.method_name = name
        return f"[{index + 1}/{count}] {name}: starting (elapsed {duration(self.method_started - self.started)})"

    def round(self, done: int, total: int, line: str) -> str:
        """The line of round ``done`` of ``total`` ended (``0/0``: a method that only evaluates), with the
        server's summary ``line``."""
        now = self.clock()
        timing = f"elapsed {duration(now - self.started)}"
        if 0 < done < total:
            timing += f", {self.method_name} eta {duration((now - self.method_started) / done * (total - done))}"
        return f"  {self.method_name} {done}/{total}: {line} ({timing})"


def duration(seconds: float) -> str:
    """``seconds`` as h:mm:ss, as rich's progress columns show time."""
    return str(timedelta(seconds=round(seconds)))
