"""A request to stop a run at its next safe point, made by Ctrl-C (SIGINT) or SIGTERM.

A signal does not stop a Flower simulation by itself: the ServerApp runs in a thread of its own and
the devices in Ray's workers, so an interrupt raised in the main thread used to be lost and the run
went on to its last round. Instead, while :func:`stopping_on_signals` holds, the first signal only
*requests* a stop; the server's round loop asks :func:`requested` after each completed round and ends
the run there (:class:`Stopped`), so every file the round wrote is whole. A second signal stops at
once, with every process the run started (Ray's): every file is written atomically, so even then a
rerun finds a consistent folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

from ondevice_moe.errors import UserError
from ondevice_moe.process_tree import kill_descendants

_requested = threading.Event()
INTERRUPTED_EXIT = 130  # the shell's code for "ended by SIGINT"


class Stopped(Exception):
    """The run stopped on request after ``completed`` rounds of the method it was running."""

    def __init__(self, completed: int) -> None:
        self.completed = completed
        super().__init__(f"stopped on request after round {completed}")


class Interrupted(UserError):
    """A run that stopped where the user asked it to; the CLI exits with 130, as the shell does for Ctrl-C."""

    exit_code = INTERRUPTED_EXIT


def requested() -> bool:
    """Whether a stop was requested (the server asks after each round)."""
    return _requested.is_set()


@contextlib.contextmanager
def stopping_on_signals(say: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM request a stop at the next safe point (``say`` tells the
    user so); a second one ends the process now with exit code 130. Outside the main thread (where
    Python cannot take signals) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(number: int, _frame: object) -> None:
        if _requested.is_set():
            say("stopped now; run the same command again to resume")
            kill_descendants(os.getpid())  # Ray's processes, which would outlive an os._exit as orphans
            os._exit(INTERRUPTED_EXIT)
        _requested.set()
        say(f"{signal.Signals(number).name}: stopping once this round is complete "
            "(press Ctrl-C again to stop now)")

    previous = {number: signal.signal(number, on_signal) for number in (signal.SIGINT, signal.SIGTERM)}
    _requested.clear()
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        _requested.clear()
