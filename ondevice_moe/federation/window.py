"""At most a window of messages out at a time (``federation.messages_in_flight``).

Flower's ``Grid.send_and_receive`` pushes a round's messages all at once, so the server holds
one message per device at the same time: for an evaluation round of 100 devices, 100 copies of
the shared experts (each message carries its own ``ArrayRecord``). :class:`WindowedGrid` sends
them through a sliding window instead: it builds and pushes the next message when a reply comes
back, so the server holds ``window`` messages, whatever the number of devices. The simulation
runs ``workers`` devices at a time anyway, so a window of a few times that costs no time there;
where messages are small (a small model's few KiB), the window grows to what
:data:`IN_FLIGHT_BYTES` of tensors allow, so a round of many devices goes out in one push rather
than one Flower pick-up (up to 0.1 s each) per pair of devices. On real devices (``flwr run`` on
SuperNodes), where every device works at once, the window is unbounded unless the recipe sets one.

Replies are pulled as they come: the wait between empty pulls starts at :data:`FIRST_PULL_SECONDS`
and doubles up to :data:`PULL_SECONDS`, so a fast round is read within milliseconds and a slow one
does not poll the SuperLink more than Flower's own grid does. Each exchange notes, per message, the
node it went to, when it was pushed and when its reply was read (:attr:`WindowedGrid.exchange`): the
strategy tells from it which device a reply the SuperLink wrote belongs to (a node that went
offline) and how long each device's messages spent outside its handler (the round's time on the
wire, transfer and Flower's pacing together).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from flwr.app import Message
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=E0611
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from ondevice_moe.recipe import FederationSection

PULL_SECONDS = 0.1  # the longest wait between empty pulls, as Flower's InMemoryGrid
FIRST_PULL_SECONDS = 0.002
WORKER_MULTIPLE = 2  # messages per simulation worker: one running, one waiting its turn
IN_FLIGHT_BYTES = 64 * 2**20  # tensors the server may hold in messages out at once, in the simulation


def simulation_cpus(federation: FederationSection) -> int:
    """The CPUs the simulation gives Ray: the machine's, or one device's when that is more."""
    return max(int(federation.cpus_per_client), os.cpu_count() or 1)


def simulation_window(federation: FederationSection) -> int:
    """The simulation's default window: ``WORKER_MULTIPLE`` messages per worker process."""
    workers = max(1, int(simulation_cpus(federation) // federation.cpus_per_client))
    return WORKER_MULTIPLE * workers


@dataclass
class Sent:
    """One message of an exchange: its destination, when it was pushed, when its reply was read."""

    node: int
    pushed: float
    answered: float | None = None


class WindowedGrid(Grid):
    """``grid`` with ``send_and_receive`` keeping at most ``window`` messages in flight.

    With ``budget_bytes``, the window of an exchange grows to as many messages as fit in that
    many bytes of serialised arrays (what the server holds; SecAgg+'s arrays carry no dtype to
    count tensors by), judged by its first message (a round's messages carry the same tensors),
    and never shrinks below ``window``. The messages are taken from their iterable one
    at a time, as the window frees up, so a lazy iterable of messages is built one message at a
    time too. ``timeout`` bounds the whole exchange, as in Flower: messages not sent by then are
    not sent, and count as unanswered. Everything else is the wrapped grid's.
    """

    def __init__(self, grid: Grid, window: int, budget_bytes: int | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.grid = grid
        self.window = window
        self.budget_bytes = budget_bytes
        self.exchange: dict[str, Sent] = {}  # the last exchange's messages, by message id

    def set_run(self, run: Run) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        return self.grid.run

    def create_message(self, *args, **kwargs) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def get_nodes(self) -> Iterable[NodeInfo]:
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(list(messages))  # the deployment grid reads its argument twice

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def exchange_window(self, first: Message) -> int:
        """The window of an exchange whose first message is ``first``."""
        if self.budget_bytes is None:
            return self.window
        size = sum(len(array.data) for record in first.content.array_records.values() for array in record.values())
        return max(self.window, self.budget_bytes // max(size, 1))

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        waiting: Iterator[Message] = iter(messages)
        first = next(waiting, None)
        if first is None:
            return []
        window = self.exchange_window(first)
        waiting = itertools.chain([first], waiting)
        in_flight: set[str] = set()
        replies: list[Message] = []
        end = None if timeout is None else time.monotonic() + timeout
        self.exchange = {}

        def fill() -> None:
            batch = list(itertools.islice(waiting, window - len(in_flight)))
            if batch:  # one push for every message that has room
                pushed = list(self.grid.push_messages(batch))
                now = time.monotonic()
                for message_id, message in zip(pushed, batch, strict=False):
                    self.exchange[message_id] = Sent(message.metadata.dst_node_id, now)
                in_flight.update(pushed)

        fill()
        pause = FIRST_PULL_SECONDS
        while in_flight and (end is None or time.monotonic() < end):
            answered = list(self.grid.pull_messages(in_flight))
            replies.extend(answered)
            now = time.monotonic()
            for reply in answered:
                if reply.metadata.reply_to_message_id in self.exchange:
                    self.exchange[reply.metadata.reply_to_message_id].answered = now
            in_flight.difference_update(reply.metadata.reply_to_message_id for reply in answered)
            fill()
            if answered:
                pause = FIRST_PULL_SECONDS
            elif in_flight:
                time.sleep(pause)
                pause = min(2 * pause, PULL_SECONDS)
        return replies
