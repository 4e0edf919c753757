"""``federation.messages_in_flight``: a round's messages go out through a sliding window."""

from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from flwr.app import Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from ondevice_moe.federation.window import WindowedGrid, simulation_window
from ondevice_moe.recipe import FederationSection, load_recipe


@pytest.fixture(autouse=True)
def _task_identity():
    """Messages need a run: Flower's engines set it in a real ServerApp process."""
    if TaskIdentity._run_id is None:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0


class EchoGrid:
    """A grid whose nodes answer each message one pull after it was pushed, or never (``silent``)."""

    def __init__(self, silent: bool = False) -> None:
        self.silent = silent
        self.pending: dict[str, Message] = {}
        self.most_in_flight = 0
        self.pushed: list[int] = []

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for message in messages:
            message_id = str(len(self.pushed))
            message.metadata.__dict__["_message_id"] = message_id  # as Flower's InMemoryGrid does
            self.pushed.append(message.metadata.dst_node_id)
            self.pending[message_id] = message
            ids.append(message_id)
        self.most_in_flight = max(self.most_in_flight, len(self.pending))
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        if self.silent:
            return []
        replies = []
        for message_id in list(message_ids):
            message = self.pending.pop(message_id)
            replies.append(Message(RecordDict(), reply_to=message))
        return replies


def _messages(count: int, built: list[int]) -> Iterator[Message]:
    for node in range(1, count + 1):
        built.append(node)
        yield Message(RecordDict(), dst_node_id=node, message_type="train")


def test_the_window_bounds_the_messages_out_and_every_one_is_answered():
    echo, built = EchoGrid(), []
    grid = WindowedGrid(echo, window=3)  # type: ignore[arg-type]
    replies = list(grid.send_and_receive(_messages(10, built), timeout=10))
    assert echo.most_in_flight == 3
    assert echo.pushed == list(range(1, 11))
    assert sorted(int(r.metadata.reply_to_message_id) for r in replies) == list(range(10))


def test_messages_are_built_only_as_the_window_frees_up():
    echo, built = EchoGrid(silent=True), []
    replies = WindowedGrid(echo, window=4).send_and_receive(_messages(10, built), timeout=0.3)  # type: ignore[arg-type]
    assert replies == []
    assert built == [1, 2, 3, 4], "a message no node has room for is never built"
    assert echo.pushed == [1, 2, 3, 4]


def test_a_window_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        WindowedGrid(EchoGrid(), window=0)  # type: ignore[arg-type]


def test_the_simulation_window_is_two_messages_per_worker(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert simulation_window(FederationSection(cpus_per_client=2)) == 8
    assert simulation_window(FederationSection(cpus_per_client=16)) == 2  # one worker, on more than the machine
    assert simulation_window(FederationSection(cpus_per_client=0.5)) == 32


def test_a_recipe_sets_the_window_and_refuses_zero():
    tiny = Path(__file__).parent / "recipes" / "tiny.yaml"
    assert load_recipe(tiny, ["federation.messages_in_flight=5"]).federation.messages_in_flight == 5
    assert load_recipe(tiny).federation.messages_in_flight is None
    with pytest.raises(Exception, match="messages_in_flight"):
        load_recipe(tiny, ["federation.messages_in_flight=0"])


def test_a_byte_budget_widens_the_window_for_small_messages_only():
    import numpy as np
    from flwr.app import ArrayRecord

    def carrying(kib: int, count: int) -> Iterator[Message]:
        for node in range(1, count + 1):
            yield Message(RecordDict({"arrays": ArrayRecord([np.zeros(kib * 256, dtype=np.float32)])}),
                          dst_node_id=node, message_type="train")

    small, large = EchoGrid(), EchoGrid()
    WindowedGrid(small, window=2, budget_bytes=64 * 1024).send_and_receive(carrying(1, 20), timeout=10)  # type: ignore[arg-type]
    WindowedGrid(large, window=2, budget_bytes=64 * 1024).send_and_receive(carrying(64, 20), timeout=10)  # type: ignore[arg-type]
    assert small.most_in_flight == 20, "twenty 1 KiB messages fit in 64 KiB: one push"
    assert large.most_in_flight == 2, "a 64 KiB message fills the budget alone: the window stays at its floor"
