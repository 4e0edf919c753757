"""Flower's own SuperNode, asking for work more often than Flower 1.41's fixed three seconds.

``python -m ondevice_moe.federation.supernode_pace POLL_S ARGS...`` runs ``flower-supernode ARGS...``
with the waits of its main loop cut. In Flower 1.41 a SuperNode that finds no message for it sleeps
3 s before it asks the SuperLink again, and waits in 0.5 s steps for its ClientApp's reply and for
the reply's bytes (``flwr/supernode/start_client_internal.py``); a round of two messages (train,
evaluate) then spends about 3 s on average, up to 7 s, waiting on that pacing alone
(docs/deployment.md, Measured). Here the wait before asking the SuperLink again is at most
``POLL_S`` seconds, and a wait on the SuperNode's own memory at most :data:`LOCAL_S`. The price of
a shorter poll is more requests to the SuperLink from an idle device: one every ``POLL_S`` seconds
instead of every 3. Its pulls of a message's objects retry sooner too
(:mod:`~ondevice_moe.federation.prompt_pulls`).

``ondevice-moe device --superlink`` starts its SuperNode this way (``--poll-s``, default
:data:`POLL_S`). Nothing else of the SuperNode changes: its code, its protocol, its arguments.
"""

from __future__ import annotations

import sys
import time
from types import ModuleType

from ondevice_moe.federation.prompt_pulls import prompt_supernode

POLL_S = 0.5
IDLE_WAIT_S = 3.0  # Flower 1.41's wait before it asks the SuperLink again; its other waits are 0.5 s
LOCAL_S = 0.02


class PacedTime:
    """The ``time`` module as the SuperNode's main loop sees it: a wait before asking the SuperLink
    again (:data:`IDLE_WAIT_S`) cut to ``poll_s``, and a wait on the SuperNode's own state (for its
    ClientApp's reply, for a reply object's bytes) cut to ``local_s``: those ask nobody but this
    process's memory."""

    def __init__(self, poll_s: float, real: ModuleType = time, local_s: float = LOCAL_S) -> None:
        self.poll_s = poll_s
        self.local_s = local_s
        self.real = real

    def sleep(self, seconds: float) -> None:
        self.real.sleep(min(seconds, self.poll_s if seconds >= IDLE_WAIT_S else self.local_s))

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def pace(poll_s: float) -> None:
    """Cut the waits of Flower's SuperNode loop (this process's) to ``poll_s`` seconds."""
    from flwr.supernode import start_client_internal

    if getattr(start_client_internal, "time", None) is not time:
        raise RuntimeError("this Flower's SuperNode loop does not wait through `time.sleep`: run "
                           "`ondevice-moe device` with --poll-s 3 (Flower's own pace)")
    start_client_internal.time = PacedTime(poll_s)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    poll_s = float(args[0])
    if poll_s < 3:
        pace(poll_s)
    prompt_supernode()
    from flwr.supernode.cli.flower_supernode import flower_supernode

    sys.argv = ["flower-supernode", *args[1:]]
    flower_supernode()


if __name__ == "__main__":
    main()
