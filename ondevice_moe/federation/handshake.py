"""Which node is which device: the handshake that starts a method, and devices that come and go.

A node says which device (user slot, its ``partition-id``) it is when asked (a ``query`` message,
:func:`~ondevice_moe.federation.client_app.identify`). :func:`connect` asks the nodes as they appear
until the recipe's devices are there (or enough of them, after a while); :class:`NodeRoster` keeps
the mapping for a method's rounds: a device that rejoins under a new node id takes its slot back,
one that joins late takes it for the first time, and a node that may not hold the slot it claims
(one another live node holds, or one that belongs to another SuperNode key,
:mod:`ondevice_moe.federation.slots`) is refused, told why, and never asked again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from logging import WARNING
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log as flwr_log

from ondevice_moe.federation.node import REFUSED
from ondevice_moe.federation.slots import SlotKeeper

POLL_SECONDS = 0.2
ALIVE_TIMEOUT_S = 15.0  # how long a node the server knows has to answer before a newcomer may take its place


class FederationFailure(RuntimeError):
    """A method cannot go on: too few devices connected or sent sound updates."""


Judge = Callable[[int, int], "str | None"]  # (device, node) → why the node may not hold the device, or None


def connect(grid: Grid, count: int, timeout: float, refuse: Callable[[int, str], None] | None = None,
            judge: Judge | None = None, enough: int | None = None, settle_s: float = 0.0) -> dict[int, int]:
    """Device index → node id, once ``count`` devices have connected and said who they are, or once
    ``settle_s`` seconds have passed with at least ``enough`` of them (default: all; the others join
    from a later round, :meth:`SlotStrategy.refresh_nodes`).

    Nodes are asked as they appear; a node claiming a ``partition-id`` another node already holds,
    one the recipe does not have, or one ``judge`` says it may not hold (a slot that belongs to
    another SuperNode key, :mod:`ondevice_moe.federation.slots`), is refused (``refuse(node, why)``)
    and the wait goes on. Waits at most ``timeout`` seconds in all; fewer than ``enough`` devices is a
    :class:`FederationFailure` naming the missing ``partition-id``s and the refusals.
    """
    enough = count if enough is None else min(enough, count)
    started = time.monotonic()
    deadline = started + timeout
    found: dict[int, int] = {}
    answered: set[int] = set()
    refusals: list[str] = []
    while len(found) < count and (left := deadline - time.monotonic()) > 0:
        if len(found) >= enough and time.monotonic() - started >= settle_s:
            break
        new = sorted(set(grid.get_node_ids()) - answered)
        if not new:
            time.sleep(POLL_SECONDS)
            continue
        held, refused, replied = identify(grid, new, count, found, left, judge)
        found.update(held)
        answered |= replied
        for node, why in refused.items():
            refusals.append(why)
            if refuse is not None:
                refuse(node, why)
        if not replied:
            time.sleep(POLL_SECONDS)
    if len(found) < enough:
        missing = sorted(set(range(count)) - set(found))
        refused_text = f"; refused: {'; '.join(refusals)}" if refusals else ""
        raise FederationFailure(f"only {len(found)} of the {count} devices the recipe needs connected within "
                                f"{timeout:g}s (federation.reply_timeout_s), fewer than the {enough} it starts "
                                f"with; missing partition-ids {missing}" + refused_text)
    return dict(sorted(found.items()))


def identify(grid: Grid, nodes: list[int], count: int, held: dict[int, int], timeout: float,
             judge: Judge | None = None) -> tuple[dict[int, int], dict[int, str], set[int]]:
    """Ask ``nodes`` which device each is. Returns the devices they newly hold (device → node), the
    nodes refused with why (a ``partition-id`` outside the recipe's ``count`` devices, one that ``judge``
    refuses, or one that ``held`` or an earlier node of ``nodes`` already holds), and the nodes that
    answered."""
    messages = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY) for node in nodes]
    replies = sorted((reply for reply in grid.send_and_receive(messages, timeout=max(timeout, POLL_SECONDS))
                      if not reply.has_error()), key=lambda reply: reply.metadata.src_node_id)
    found: dict[int, int] = {}
    refused: dict[int, str] = {}
    for reply in replies:
        node = reply.metadata.src_node_id
        try:
            device = int(reply.content["metrics"]["device"])
        except (KeyError, TypeError, ValueError):
            refused[node] = f"node {node} did not say which partition-id it is"
            continue
        owner = held.get(device, found.get(device))
        if not 0 <= device < count:
            refused[node] = f"node {node} says it is partition-id {device}, but the recipe has devices 0 to {count - 1}"
        elif judge is not None and (problem := judge(device, node)):
            refused[node] = problem
        elif owner is not None and owner != node:
            refused[node] = f"node {node} claims partition-id {device}, which node {owner} already holds"
        else:
            found[device] = node
    return found, refused, {reply.metadata.src_node_id for reply in replies}


def tell_refused(grid: Grid, node: int, why: str) -> None:
    """Send a refused node one query saying why, so its own log shows it (no reply is awaited)."""
    grid.push_messages([Message(RecordDict({"config": ConfigRecord({REFUSED: why})}), dst_node_id=node,
                                message_type=MessageType.QUERY)])


class NodeRoster:
    """Device index ↔ node id for one method's rounds (see :func:`connect`).

    ``record(fields)`` writes an event of the method to the run's log (``rejoin``, ``join``,
    ``refused``); ``keeper`` says which SuperNode key may hold which slot (``None``: any node, while
    it answers); ``devices``: how many the recipe has; ``timeout``: how long a node may take to say
    who it is."""

    def __init__(self, nodes: dict[int, int], devices: int, record: Callable[[dict[str, Any]], None],
                 keeper: SlotKeeper | None = None, timeout: float = 60.0) -> None:
        self.nodes: dict[int, int] = {}
        self.devices: dict[int, int] = {}
        self.count = devices
        self.record = record
        self.keeper = keeper
        self.timeout = timeout
        self.refused: set[int] = set()
        for device, node in nodes.items():
            self.take(device, node)

    def judge(self, device: int, node: int) -> str | None:
        return self.keeper.problem(device, node) if self.keeper is not None else None

    def refresh(self, grid: Grid) -> None:
        """Follow devices that rejoined under a new node id (a restarted SuperNode without node
        authentication registers anew) or join late: nodes the server has not seen are asked who they
        are; one that may hold a device takes its place (a ``rejoin`` or ``join`` record); one claiming
        a device another answering node holds, one whose key may not hold it, or no device of the
        recipe, is refused (a ``refused`` record, and the node is told why)."""
        online = set(grid.get_node_ids())
        new = sorted(online - set(self.devices) - self.refused)
        if not new:
            return
        if self.keeper is not None:
            self.keeper.see(grid)
        found, refused, _ = identify(grid, new, self.count, {}, self.timeout, self.judge)
        # The SuperLink lists a killed node for a while (until its heartbeats are missed): ask the old nodes,
        # unless the newcomer proved the key the slot belongs to (an authenticated SuperNode keeps its node id).
        keyless = {device: node for device, node in found.items() if not self._keyed(node)}
        owners = sorted({self.nodes[device] for device in keyless if device in self.nodes} & online)
        alive = identify(grid, owners, self.count, {}, min(ALIVE_TIMEOUT_S, self.timeout))[2] if owners else set()
        for device, node in list(found.items()):
            if device in keyless and self.nodes.get(device) in alive:
                refused[node] = f"node {node} claims partition-id {device}, which node {self.nodes[device]} holds"
                del found[device]
        for device, node in found.items():
            old = self.nodes.get(device)
            if old is not None:
                self.devices.pop(old, None)
                self.record({"kind": "rejoin", "device": device, "old_node": old, "node": node})
            else:
                self.record({"kind": "join", "device": device, "node": node})
            self.take(device, node)
        for node, why in refused.items():
            self.refuse(grid, node, why)

    def take(self, device: int, node: int) -> None:
        """``node`` holds ``device`` from now on (its key claims the slot for the run)."""
        self.nodes[device] = node
        self.devices[node] = device
        if self.keeper is not None:
            self.keeper.accept(device, node)

    def refuse(self, grid: Grid, node: int, why: str) -> None:
        """Log that ``node`` is refused and why, tell the node, and never ask it again."""
        self.refused.add(node)
        self.record({"kind": "refused", "node": node, "reason": why})
        flwr_log(WARNING, "refused a node: %s", why)
        tell_refused(grid, node, why)

    def _keyed(self, node: int) -> bool:
        return self.keeper is not None and self.keeper.key_of(node) is not None
