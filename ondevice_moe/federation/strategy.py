"""The server as a Flower strategy: sample devices, send each its own message,
drop the devices that fail, fold the rest into the server rule's slots.

:meth:`SlotStrategy.run` drives the rounds as Flower's :meth:`Strategy.start` does (train →
aggregate → evaluate, every wait bounded by ``federation.reply_timeout_s``), from the round a
continued run takes up (:mod:`ondevice_moe.federation.round_state`); this strategy decides what
is sent and what is kept:

* **State** is the server rule's named slots of tensors (``job.server_rule``,
  :mod:`ondevice_moe.server_rules.rules`), carried between Flower's calls as one
  ``ArrayRecord`` with ``<slot>/<tensor>`` names. Each device is sent
  ``rule.message_for(slots, device, train_round)``: shared tensors only (CoMiGS Alg. 1).
* **Sampling**: ``clients_per_round`` devices, or ``fraction_train`` of them,
  drawn per round from the recipe seed (all devices by default); the server rule may keep fewer
  of them (:meth:`~ondevice_moe.server_rules.rules.ServerRule.devices_to_train`).
* **Devices** are the nodes of a :class:`~ondevice_moe.federation.handshake.NodeRoster`: they
  rejoin, join late and are refused between rounds.
* **Failures**: a device that raises, goes offline, does not reply in time, is not connected, or
  sends an update :func:`check_update` rejects is dropped from the round (a ``drop`` record
  saying which; its bytes are not counted as uploaded). A round with fewer than ``min_clients``
  sound updates ends the method.
* **Transport**: what travels both ways is encoded by ``federation.transport``
  (:mod:`ondevice_moe.server_rules.transport`); an upload is checked as it travelled,
  then decoded, and the rule aggregates decoded values. Byte counts are of what travelled.
* **Evaluation** every ``eval_every`` rounds and after the last one, on every
  device; the last one also has the devices write their checkpoints. On real devices a round's
  evaluation rides on the next round's training messages where it can
  (:mod:`~ondevice_moe.federation.riding`).
* **Timing**: each reply carries its handler's own time and worker process; a ``round``
  record per round holds the round's wall time, the share of it no handler explains and the
  time the slowest device's messages spent on the wire (:meth:`SlotStrategy._log_round`).
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from logging import INFO
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log as flwr_log

from ondevice_moe import stop_request
from ondevice_moe.errors import UserError
from ondevice_moe.federation.accountant import PrivacyLedger
from ondevice_moe.federation.device import save_server_checkpoint
from ondevice_moe.federation.evaluation import user_values
from ondevice_moe.federation.handshake import FederationFailure, NodeRoster
from ondevice_moe.federation.job import Job
from ondevice_moe.federation.privacy import noise_std
from ondevice_moe.federation.riding import EVALUATE_ROUND, EVALUATION, rides, same_message
from ondevice_moe.federation.secure_aggregation import SecureRound, secure_round
from ondevice_moe.federation.slots import SlotKeeper
from ondevice_moe.federation.window import Sent, WindowedGrid
from ondevice_moe.federation.wire import pack, record_bytes, unpack
from ondevice_moe.methods.base import is_expert_tensor
from ondevice_moe.recipe import FederationSection
from ondevice_moe.report import MetricsLog
from ondevice_moe.server_rules.aggregation import Update, bounded_counts, check_update, norm_outliers
from ondevice_moe.server_rules.robust import robust_updates
from ondevice_moe.server_rules.rules import Slots
from ondevice_moe.server_rules.transport import Transport, decode, encode

Progress = Callable[[int, int, str], None]
KeepRound = Callable[[int, Slots], None]
RUN_KEY = "run-key"  # a message's config: the run it belongs to (device_snapshots)
NODE_UNAVAILABLE = 5  # Flower's ErrorCode.NODE_UNAVAILABLE: the node missed its heartbeats
LOST_ON_THE_WAY = (3, 4)  # Flower's MESSAGE_UNAVAILABLE, REPLY_MESSAGE_UNAVAILABLE: expired or never arrived whole
WAIT_SECONDS = 2.0  # between looks for devices to come back online

def pack_slots(slots: Slots) -> ArrayRecord:
    """All slots in one ``ArrayRecord``, each tensor under ``<slot>/<name>``."""
    return ArrayRecord({f"{slot}/{name}": t for slot, tensors in slots.items() for name, t in tensors.items()})


def unpack_slots(record: ArrayRecord, empty: Slots) -> Slots:
    """The slots of :func:`pack_slots`; ``empty`` names the slots that may hold nothing yet."""
    slots: Slots = {slot: {} for slot in empty}
    for key, tensor in record.to_torch_state_dict().items():
        slot, name = key.split("/", 1)
        slots.setdefault(slot, {})[name] = tensor
    return slots


def devices_per_round(federation: FederationSection, devices: int) -> int:
    """How many devices train each round; a recipe asking the impossible is a :class:`UserError`."""
    if federation.clients_per_round is not None:
        count = federation.clients_per_round
        if count > devices:
            raise UserError(f"federation.clients_per_round is {count} but the recipe has only {devices} devices",
                            f"use at most {devices}")
    elif federation.fraction_train is not None:
        count = max(1, int(federation.fraction_train * devices))
    else:
        count = devices
    if federation.min_clients > count:
        raise UserError(f"federation.min_clients is {federation.min_clients} but only {count} of {devices} devices "
                        "train each round", f"set federation.min_clients to at most {count}")
    return count


def sample_devices(devices: int, count: int, seed: int, server_round: int) -> list[int]:
    """The devices that train in ``server_round``: the same for the same seed and round."""
    if count >= devices:
        return list(range(devices))
    return sorted(random.Random(f"{seed}:sample:{server_round}").sample(range(devices), count))


def decode_update(update: Update, reference: dict[str, torch.Tensor], kind: Transport,
                  partial: bool) -> tuple[Update, str | None]:
    """``update`` with its tensors decoded (in ``reference``'s dtypes), once it passed
    :func:`check_update` as it travelled, so an upload in a wider dtype than ``kind`` sends
    is caught; or, unchanged, with why it is rejected."""
    problem = check_update(update, encode(reference, kind), partial)  # the reference as it would travel
    if problem:
        return update, problem
    try:
        decoded = decode(update.tensors, kind, reference)
    except ValueError as error:
        return update, f"device {update.device} sent a malformed upload: {error}"
    for name, tensor in decoded.items():  # fp32 travels as it is: a bool or int8 upload must not become the global
        if tensor.dtype != reference[name].dtype:
            return update, f"device {update.device} sent {name} as {tensor.dtype}, expected {reference[name].dtype}"
    return replace(update, tensors=decoded), None


class SlotStrategy(Strategy):
    """One method's federation: the server rule's slots, per-device messages, dropped devices.

    ``nodes``: device index → Flower node id (:func:`~ondevice_moe.federation.handshake.connect`),
    followed as devices come and go by :attr:`roster`, which ``keeper`` (real devices) holds to
    the run's slot keys; ``log``: the run's ``metrics.jsonl``; ``progress``: called after each
    round with ``(round, total_rounds, line)``. A continued run (``first_round`` after 1) starts
    from the ``slots`` it kept (``evaluation_missing``: the log holds no evaluation of that round);
    ``keep_round(round, slots)`` keeps them after each round;
    ``run_key`` goes to every device with each message (its state of this run, not another's).
    """

    def __init__(self, job: Job, nodes: dict[int, int], log: MetricsLog, progress: Progress | None = None,
                 keeper: SlotKeeper | None = None, run_key: str | None = None, first_round: int = 1,
                 slots: Slots | None = None, keep_round: KeepRound | None = None,
                 evaluation_missing: bool = False) -> None:
        self.job = job
        self.evaluation_missing = evaluation_missing
        self.rule = job.server_rule
        self.log = log
        self.progress = progress
        self.run_key = run_key
        self.first_round = first_round
        self.keep_round = keep_round
        federation = job.recipe.federation
        self.federation = federation
        self.total_rounds = federation.rounds if job.method.trains else 0
        self.riding = rides(job) and federation.secure_aggregation == "none"
        self.count = len(job.method.layouts)
        self.roster = NodeRoster(nodes, self.count, self.record, keeper, federation.reply_timeout_s)
        self.per_round = devices_per_round(federation, self.count)
        self.slots: Slots = slots if slots is not None else self.rule.initial_slots()
        self._fresh: dict[int, dict[str, torch.Tensor]] = {}
        self._round: dict[str, Any] = {}
        self._grid: Grid | None = None
        self._privacy = PrivacyLedger(job.recipe.privacy.noise_multiplier, job.recipe.privacy.delta)
        for done in range(1, first_round):  # the rounds a continued run took before: the devices sampled then
            self._privacy.record_round(self._sampled(done))  # (a superset where the rule chose among them)

    @property
    def nodes(self) -> dict[int, int]:
        """Device index → the node that holds it now."""
        return self.roster.nodes

    @property
    def devices(self) -> dict[int, int]:
        """Node id → the device it holds."""
        return self.roster.devices

    def summary(self) -> None:
        flwr_log(INFO, "\t├──> %s: %d of %d devices per round, min %d sound updates, timeout %gs",
                 self.job.method.name, self.per_round, self.count, self.federation.min_clients,
                 self.federation.reply_timeout_s)

    def run(self, grid: Grid) -> None:
        """Every round from ``first_round`` to the last, as Flower's :meth:`Strategy.start` runs them:
        train, aggregate, evaluate (where :meth:`evaluates` says), then keep the round. A round's
        evaluation rides on the next round's training messages where it can
        (:mod:`~ondevice_moe.federation.riding`); a continued run whose last kept round's evaluation was
        not read evaluates it first. A stop requested meanwhile (Ctrl-C, :mod:`ondevice_moe.stop_request`)
        ends the run here, between rounds, its last round evaluated on its own."""
        arrays = pack_slots(self.slots)
        riding = self._unevaluated(grid, arrays)  # the round whose evaluation rides on this round's messages
        for server_round in range(self.first_round, self.total_rounds + 1):
            replies = list(grid.send_and_receive(self.configure_train(server_round, arrays, ConfigRecord(), grid,
                                                                      riding),
                                                 timeout=self.federation.reply_timeout_s))
            evaluated = []  # (round, mean) of each evaluation read with this round
            if riding is not None:
                evaluated.append((riding, self.aggregate_evaluate(riding, replies, EVALUATION)))
            arrays, _ = self.aggregate_train(server_round, replies)
            stopping = stop_request.requested() and server_round < self.total_rounds
            riding = server_round if self._rides_on_next(server_round) and not stopping else None
            if riding is None and self.evaluates(server_round):
                evaluated.append((server_round, self._evaluate_apart(grid, server_round, arrays)))
            self._log_round(server_round)
            self._report(server_round, evaluated)
            if self.keep_round is not None:
                self.keep_round(server_round, self.slots)
            if stopping:
                raise stop_request.Stopped(server_round)

    def _unevaluated(self, grid: Grid, arrays: ArrayRecord) -> int | None:
        """A continued run's last kept round, where it evaluates but its evaluation was not read (it was
        to ride on the round cut short): the round whose evaluation rides on the first round's messages,
        or, where it cannot, evaluated now in its own exchange."""
        kept = self.first_round - 1
        if not (kept and self.evaluation_missing and self.evaluates(kept)):
            return None
        if self._rides_on_next(kept):
            return kept
        self._round = {"started": time.perf_counter()}
        self._evaluate_apart(grid, kept, arrays)
        return None

    def _evaluate_apart(self, grid: Grid, server_round: int, arrays: ArrayRecord) -> float | None:
        """Round ``server_round``'s evaluation in an exchange of its own; the devices' mean headline figure."""
        replies = grid.send_and_receive(self.configure_evaluate(server_round, arrays, ConfigRecord(), grid),
                                        timeout=self.federation.reply_timeout_s)
        return self.aggregate_evaluate(server_round, replies)

    def _rides_on_next(self, server_round: int) -> bool:
        """Whether round ``server_round``'s evaluation can ride on round ``server_round + 1``'s training
        messages: it evaluates, the next round trains every device on the same tensors, without SecAgg+."""
        if not (self.riding and self.evaluates(server_round) and server_round < self.total_rounds):
            return False
        following = server_round + 1
        everyone = sorted(self.rule.devices_to_train(self.slots, self._sampled(following))) == list(range(self.count))
        return everyone and all(same_message(self.rule, self.slots, device, following) for device in range(self.count))

    def record(self, fields: dict[str, Any]) -> None:
        """Write an event of this method to the run's log, naming the user of its ``device``."""
        if "device" in fields and "user" not in fields:
            fields = {**fields, "user": self._user(fields["device"])}
        self.log.write({"method": self.job.method.name, **fields})

    def _sampled(self, server_round: int) -> list[int]:
        return sample_devices(self.count, self.per_round, self.job.recipe.seed, server_round)

    def _online(self, grid: Grid, wanted: list[int]) -> list[int]:
        """The devices of ``wanted`` whose node is online (Flower lists only those). With fewer than
        ``min_clients`` of them, the round waits (up to ``reply_timeout_s``) for devices to come back:
        a restarted SuperNode takes a few seconds to connect, a killed one a minute or so to be let in
        again. Where Flower lists no node as online (the simulation), every device counts as online."""
        enough = min(self.federation.min_clients, len(wanted))
        deadline = time.monotonic() + self.federation.reply_timeout_s
        while True:
            online = set(grid.get_node_ids())
            present = [device for device in wanted if self.nodes.get(device) in online]
            if len(present) >= enough or time.monotonic() >= deadline:
                return present
            time.sleep(WAIT_SECONDS)
            self.roster.refresh(grid)

    def _absent(self, device: int) -> str:
        """Why a device was not sent the round's message."""
        if device not in self.nodes:
            return f"not connected: no node holds partition-id {device}"
        return f"offline when the round began (node {self.nodes[device]} is not connected)"

    # -- training -------------------------------------------------------------

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid, riding: int | None = None) -> Iterable[Message]:
        """The round's training messages; ``riding``: the round whose evaluation they carry too."""
        self._grid = grid
        self.roster.refresh(grid)
        self.slots = unpack_slots(arrays, self.rule.initial_slots())
        sampled = self.rule.devices_to_train(self.slots, self._sampled(server_round))
        started = time.perf_counter()
        present = self._online(grid, sampled)
        self._round = {"started": started, "sampled": sampled, "present": present, "sent": {}}
        if riding is not None:
            self._round.update(asked=present, evaluation_started=started)
        self._privacy.record_round(sampled)
        messages = self._train_messages(present, server_round, riding)
        if self.federation.secure_aggregation == "secaggplus":
            # SecAgg+'s four round trips run here, where Flower hands over the Grid; Flower then sends nothing.
            by_node = {self.nodes[device]: message for device, message in zip(present, messages, strict=True)}
            self._round["secure"] = secure_round(grid, by_node, self._common_reference(present), self.federation,
                                                 server_round)
            return []
        return messages

    def _train_messages(self, sampled: list[int], server_round: int, riding: int | None) -> Iterator[Message]:
        """The sampled devices' training messages, each built when the grid takes it (so a
        :class:`~ondevice_moe.federation.window.WindowedGrid` holds only its window of them),
        its bytes then counted as sent."""
        for device in sampled:
            message = self._message(device, MessageType.TRAIN, server_round, final=False, riding=riding)
            self._round["sent"][device] = record_bytes(message.content["arrays"])
            yield message

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        drops = {device: self._absent(device) for device in self._round["sampled"]
                 if device not in self._round["present"]}
        secure = self._round.get("secure")
        if secure is None:
            sound, bytes_up, bytes_up_other = self._sound_updates(server_round, replies, drops)
            devices = len(sound)
        else:
            sound, bytes_up, bytes_up_other = self._secure_updates(server_round, secure, drops)
            devices = len(secure.metrics)
        self._record_drops(server_round, "train", drops)
        if devices < self.federation.min_clients:
            reasons = "; ".join(f"device {d}: {why}" for d, why in sorted(drops.items()))
            raise FederationFailure(
                f"round {server_round}: {devices} of {len(self._round['sampled'])} devices sent a sound update, "
                f"fewer than federation.min_clients={self.federation.min_clients} ({reasons or 'no replies'})")
        federation = self.federation
        combined = robust_updates(sound, federation.aggregation, federation.trim_fraction, federation.byzantine)
        self.slots = self.rule.aggregate(self.slots, combined)
        self.log.write({"method": self.job.method.name, "round": server_round, "kind": "comm", "bytes_up": bytes_up,
                        "bytes_up_not_experts": bytes_up_other, "bytes_down": sum(self._round["sent"].values()),
                        "devices": devices, "dropped": len(drops)})
        self._log_privacy(server_round)
        self._round.update(bytes_up=bytes_up, drops=sorted(drops))
        return pack_slots(self.slots), MetricRecord({"devices": devices, "dropped": len(drops)})

    def _sound_updates(self, server_round: int, replies: Iterable[Message],
                       drops: dict[int, str]) -> tuple[list[Update], int, int]:
        """The round's sound updates, decoded, with the bytes they took (all, and outside experts);
        each device's ``train`` record is written, the rest go to ``drops``."""
        sound: list[tuple[Update, dict[str, Any], int, dict[str, torch.Tensor]]] = []
        bytes_up = bytes_up_other = 0
        for device, reply in self._by_device(replies, self._round["present"], drops, self._round["started"]):
            update, metrics, size, problem = self._read_update(reply, device)
            wire = update.tensors
            if not problem:
                update, problem = decode_update(update, self._reference(device), self.federation.transport,
                                                self.rule.partial_uploads)
            if not problem:  # numbers in bounds: now what they mean, to the method's rule
                problem = self.rule.check_records(update)
            if problem:
                drops[device] = f"update rejected: {problem}"
                continue
            sound.append((update, metrics, size, wire))
        if self.federation.update_norm_bound is not None:
            outliers = norm_outliers([update for update, *_ in sound], self._held_norm(),
                                     self.federation.update_norm_bound)
            drops.update({device: f"update rejected: {why}" for device, why in outliers.items()})
            sound = [entry for entry in sound if entry[0].device not in outliers]
        updates, capped = bounded_counts([update for update, *_ in sound], self._held_examples())
        for update, metrics, size, wire in sound:
            bytes_up += size
            bytes_up_other += sum(t.nbytes for name, t in wire.items() if not is_expert_tensor(name))
            if update.device in capped:  # its claim counted only as far as the bound
                metrics["examples_counted"] = next(u.num_examples for u in updates if u.device == update.device)
            self._log_train(server_round, update.device, metrics, size)
        return updates, bytes_up, bytes_up_other

    def _held_examples(self) -> dict[int, int] | None:
        """Device → the training examples its data holds, where the server knows it (a task dealt from the
        recipe; the centralized method's one device holds them all); ``None`` for the users' own text."""
        if "held" not in self._round:
            from ondevice_moe.federation import device as dev

            sizes = dev.training_sizes(self.job)
            self._round["held"] = None if sizes is None else (
                {0: sum(sizes)} if self.job.method.centralized else dict(enumerate(sizes)))
        return self._round["held"]

    def _held_norm(self) -> float | None:
        """The L2 norm of what the server holds and sends (``None`` before it holds anything)."""
        held = [tensor for slot in self.slots.values() for tensor in slot.values()]
        return math.sqrt(sum(float(t.double().pow(2).sum()) for t in held)) if held else None

    def _secure_updates(self, server_round: int, secure: SecureRound,
                        drops: dict[int, str]) -> tuple[list[Update], int, int]:
        """A SecAgg+ round as the rule sees it: one update, the devices' weighted mean (so the rule's
        mean of it is itself). Bytes are all a device sent in the protocol's four stages."""
        finished = {self.devices[node]: metrics for node, metrics in secure.metrics.items()}
        for device in self._round["present"]:
            if device not in finished:
                drops[device] = "dropped out of SecAgg+ (" + ("; ".join(secure.failures) or "no reply") + ")"
        if secure.mean is None:
            reasons = "; ".join(secure.failures) or "too few devices stayed for the reconstruction threshold"
            raise FederationFailure(f"round {server_round}: SecAgg+ halted without an aggregate ({reasons})")
        bytes_up = bytes_up_other = 0
        for device, metrics in sorted(finished.items()):
            node = self.nodes[device]
            bytes_up += secure.bytes_up[node]
            bytes_up_other += sum(size for name, size in secure.masked_bytes.get(node, {}).items()
                                  if not is_expert_tensor(name))
            self._log_train(server_round, device, metrics, secure.bytes_up[node])
        return [Update(-1, secure.mean, 1)], bytes_up, bytes_up_other

    def _log_train(self, server_round: int, device: int, metrics: dict[str, Any], size: int) -> None:
        self._time_handler(device, metrics)
        if "update_norm" in metrics:  # the device clipped its update (recipe ``privacy``)
            self._round.setdefault("norms", {})[self._user(device)] = metrics["update_norm"]
        self.log.write({**metrics, "method": self.job.method.name, "round": server_round, "kind": "train",
                        "user": self._user(device), "bytes_up": size, "bytes_down": self._round["sent"][device]})

    def _log_privacy(self, server_round: int) -> None:
        """The round's ``privacy`` record: the recipe's bound and noise, what the devices
        reported (their updates' norms before clipping, how many were clipped), and the (ε, δ)
        spent so far by the device that took part most often (``epsilon`` null without noise)."""
        privacy = self.job.recipe.privacy
        if not privacy.enabled:
            return
        norms = self._round.get("norms", {})
        spent = self._privacy.epsilon()
        self.log.write({"method": self.job.method.name, "round": server_round, "kind": "privacy",
                        "clip_norm": privacy.clip_norm, "noise_multiplier": privacy.noise_multiplier,
                        "noise_std": noise_std(privacy), "devices": len(norms),
                        "clipped": sum(norm > privacy.clip_norm for norm in norms.values()),
                        "update_norms": norms, "sampling_rate": self.per_round / self.count,
                        "uploads": self._privacy.most_uploads, "epsilon": spent if math.isfinite(spent) else None,
                        "delta": privacy.delta})

    def _common_reference(self, sampled: list[int]) -> dict[str, torch.Tensor]:
        """The names, shapes and dtypes every sampled device uploads: SecAgg+ sums one vector layout."""
        references = {device: self._reference(device) for device in sampled}
        first = sampled[0]
        layout = {name: (tuple(t.shape), t.dtype) for name, t in references[first].items()}
        for device, reference in references.items():
            if {name: (tuple(t.shape), t.dtype) for name, t in reference.items()} != layout:
                raise FederationFailure(f"devices {first} and {device} upload different tensors, which SecAgg+ "
                                        "cannot sum; use the same layout on every device or "
                                        "federation.secure_aggregation: none")
        return references[first]

    # -- evaluation -----------------------------------------------------------

    def evaluates(self, server_round: int) -> bool:
        return server_round == self.total_rounds or server_round % self.federation.eval_every == 0

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        self._grid = grid
        self.roster.refresh(grid)
        self._round["evaluation_started"] = time.perf_counter()
        self.slots = unpack_slots(arrays, self.rule.initial_slots())
        final = server_round == self.total_rounds
        kept = self.rule.final_state(self.slots) if final else {}
        if final and not kept and self.job.submitted:  # on real devices the server keeps the shared experts too
            kept = dict(pack_slots(self.slots).to_torch_state_dict())
        if kept:
            save_server_checkpoint(self.job, kept)
        self._round["asked"] = self._online(grid, sorted(self.nodes))
        return (self._message(device, MessageType.EVALUATE, server_round, final) for device in self._round["asked"])

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message],
                           record: str = "metrics") -> float | None:
        """Write each device's ``eval`` records from its reply's ``record`` (``metrics``: an evaluate reply;
        :data:`~ondevice_moe.federation.riding.EVALUATION`: a training reply it rode on); the mean
        headline figure over devices (``None``: no device could be evaluated)."""
        drops = {device: self._absent(device) for device in range(self.count) if device not in self._round["asked"]}
        headline = []
        asked = self._round["asked"]
        own_exchange = record == "metrics"  # a ridden-on exchange is timed with its training
        for device, reply in self._by_device(replies, asked, drops, self._round["evaluation_started"], own_exchange):
            if record not in reply.content.metric_records:
                drops[device] = f"malformed reply (no {record} record)"
                continue
            metrics = dict(reply.content[record])
            if own_exchange:
                self._time_handler(device, metrics)
            for index in self._own_users(device):  # a device reports for the users it holds, nobody else
                values = user_values(metrics, index)
                if values:
                    headline.append(values.get("test_ppl_in", values.get("score")))
                    self.log.write({**values, "method": self.job.method.name, "round": server_round, "kind": "eval",
                                    "user": self.job.recipe.user_names[index]})
        self._record_drops(server_round, "evaluate", drops)
        evaluated = self.count - len(drops)
        if server_round == self.total_rounds and evaluated < min(self.federation.min_clients, self.count):
            reasons = "; ".join(f"device {d}: {why}" for d, why in sorted(drops.items())) or "none connected"
            raise FederationFailure(f"the final evaluation succeeded on {evaluated} of {self.count} devices, "
                                    f"fewer than federation.min_clients={self.federation.min_clients} ({reasons})")
        return sum(headline) / len(headline) if headline else None

    def evaluate_untrained(self, grid: Grid) -> None:
        """The single evaluation of a method that does not train (the pretrained reference)."""
        self._round = {"started": time.perf_counter()}
        self._report(0, [(0, self._evaluate_apart(grid, 0, pack_slots(self.slots)))])

    # -- round overhead -------------------------------------------------------

    def _time_handler(self, device: int, metrics: dict[str, Any]) -> None:
        """Note the seconds a device's handler took (``handler_s``), the worker process that ran it and
        how often that process has loaded a base model (``worker``, ``base_loads``: taken out of
        ``metrics``, they describe the process, not the device's results)."""
        worker = metrics.pop("worker", None)
        loads = metrics.pop("base_loads", None)
        if loads is not None:
            self._round.setdefault("base_loads", {})[worker] = int(loads)
        if "handler_s" in metrics:
            self._round.setdefault("handlers", []).append((device, worker, float(metrics["handler_s"])))

    def _time_exchange(self, device: int, reply: Message) -> None:
        """Note how long a device's message and its reply took, from the server pushing it to reading the
        reply (what :class:`~ondevice_moe.federation.window.WindowedGrid` saw of the exchange)."""
        sent = self._exchanged(reply)
        if sent is not None and sent.answered is not None:
            exchanges = self._round.setdefault("exchanges", {})
            exchanges[device] = exchanges.get(device, 0.0) + sent.answered - sent.pushed

    def _log_round(self, server_round: int) -> None:
        """The round's ``round`` record: its wall time (the server sending the first train message to the
        last reply read: training, its own evaluation's, or, where the previous round's evaluation rode on
        its messages, that evaluation's too), the slowest client's train + evaluate time, the busiest worker's
        (the handlers one worker process ran, in turn) and the overhead: the share of the wall time
        that is neither, ``(wall_s - busiest_worker_s) / wall_s``. Where every client has its own
        worker, the busiest worker's time is the slowest client's. ``base_loads``: the most base-model
        loads any worker of the round has made since it started (1: loaded once per process).
        ``wire_s``: on real devices, the most time one device's messages of the round spent between the
        server and its handler, both ways (its exchanges' time less its handlers' time: transfer over
        its link and Flower's pacing, which polls for work every few seconds); ``None`` where the grid
        does not see exchanges (the simulation's)."""
        wall = time.perf_counter() - self._round["started"]
        per_device: dict[int, float] = {}
        per_worker: dict[Any, float] = {}
        for device, worker, seconds in self._round.get("handlers", []):
            per_device[device] = per_device.get(device, 0.0) + seconds
            per_worker[worker] = per_worker.get(worker, 0.0) + seconds
        busiest = max(per_worker.values(), default=0.0)
        exchanges = self._round.get("exchanges", {}) if self.job.submitted else {}
        wire = max((exchanges[device] - per_device.get(device, 0.0) for device in exchanges), default=None)
        self.log.write({"method": self.job.method.name, "round": server_round, "kind": "round", "wall_s": wall,
                        "slowest_client_s": max(per_device.values(), default=0.0), "busiest_worker_s": busiest,
                        "workers": len(per_worker), "clients": len(per_device),
                        "base_loads": max(self._round.get("base_loads", {}).values(), default=0),
                        "overhead": (wall - busiest) / wall, "wire_s": wire})

    # -- helpers --------------------------------------------------------------

    def _message(self, device: int, kind: str, server_round: int, final: bool, riding: int | None = None) -> Message:
        train_round = server_round if kind == MessageType.TRAIN else None
        arrays = pack(encode(self.rule.message_for(self.slots, device, train_round), self.federation.transport))
        config = ConfigRecord({"server-round": server_round, "final": final, "method": self.job.method_index})
        if riding is not None:
            config[EVALUATE_ROUND] = riding
        if self.run_key is not None:
            config[RUN_KEY] = self.run_key
        return Message(RecordDict({"arrays": arrays, "config": config}), dst_node_id=self.nodes[device],
                       message_type=kind, group_id=str(server_round))

    def _by_device(self, replies: Iterable[Message], expected: list[int], drops: dict[int, str],
                   started: float, timed: bool = True) -> list[tuple[int, Message]]:
        """Sound replies in device order (so aggregation is deterministic); the rest go to ``drops``, each
        with what happened: it raised, went offline (the SuperLink answers for a node that missed its
        heartbeats), or sent nothing before the exchange ended (``started``: when it began). ``timed``:
        note each reply's exchange time (once per exchange)."""
        answered: dict[int, Message] = {}
        for reply in replies:
            device = self._sender(reply)
            if device is None:
                continue
            answered[device] = reply
            if reply.has_error():
                drops[device] = _error_reason(reply.error.code, reply.error.reason)
            elif timed:
                self._time_exchange(device, reply)
        waited = time.perf_counter() - started
        timeout = self.federation.reply_timeout_s
        for device in expected:
            if device not in answered:
                drops[device] = (f"no reply within {timeout:g}s" if waited >= timeout
                                 else f"no reply (the exchange ended after {waited:.0f}s)")
        return [(device, answered[device]) for device in sorted(answered) if device not in drops]

    def _sender(self, reply: Message) -> int | None:
        """The device a reply answers for: that of the node its message went to (a reply Flower wrote
        itself, for a node that went offline or a reply lost on the way, has another sender), else that
        of its sender's node."""
        sent = self._exchanged(reply)
        return self.devices.get(sent.node if sent is not None else reply.metadata.src_node_id)

    def _exchanged(self, reply: Message) -> Sent | None:
        """What the windowed grid noted of the message ``reply`` answers (``None`` on another grid)."""
        if not isinstance(self._grid, WindowedGrid):
            return None
        return self._grid.exchange.get(reply.metadata.reply_to_message_id)

    def _read_update(self, reply: Message, device: int) -> tuple[Update, dict[str, Any], int, str | None]:
        """The update a reply carries, its train metrics, its size in bytes, and why it is malformed."""
        content = reply.content
        try:
            metrics = dict(content["metrics"])
            arrays = content["arrays"]
            records = {key: dict(record) for key, record in content.metric_records.items()
                       if key not in ("metrics", EVALUATION)}
            examples = metrics["num-examples"]
            if isinstance(examples, bool) or not float(examples).is_integer():
                raise ValueError(f"num-examples {examples!r} is not a whole number")
            update = Update(device, unpack(arrays), int(examples), records)
        except (KeyError, TypeError, ValueError, OverflowError) as error:
            return Update(device, {}, 0), {}, 0, f"malformed reply ({type(error).__name__}: {error})"
        beside = sum(content[key].count_bytes() for key in records)
        metrics.pop("device", None)
        if beside:
            metrics["bytes_up_records"] = beside  # of bytes_up: the records beside the tensors
        return update, metrics, record_bytes(arrays) + beside, None

    def _reference(self, device: int) -> dict[str, torch.Tensor]:
        """Names, shapes and dtypes device ``device`` may upload: the rule's reference once
        the slots hold something, before that (and always where devices upload a part of their
        experts, whose whole set the slots may not hold yet) the upload of a freshly built device model."""
        reference = {} if self.rule.partial_uploads else self.rule.reference(self.slots, device)
        if reference:
            return reference
        if device not in self._fresh:
            from ondevice_moe.federation import device as dev

            self._fresh[device] = dev.upload_reference(self.job, device)
        return self._fresh[device]

    def _record_drops(self, server_round: int, phase: str, drops: dict[int, str]) -> None:
        for device, reason in sorted(drops.items()):
            self.log.write({"method": self.job.method.name, "round": server_round, "kind": "drop", "phase": phase,
                            "device": device, "user": self._user(device), "reason": reason})

    def _own_users(self, device: int) -> range | list[int]:
        """The users device ``device`` holds: every user for the centralized upper bound, else its own."""
        return range(len(self.job.recipe.user_names)) if self.job.method.centralized else [device]

    def _user(self, device: int) -> str:
        return "all" if self.job.method.centralized else self.job.recipe.user_names[device]

    def _report(self, server_round: int, evaluated: list[tuple[int, float | None]]) -> None:
        """The progress line of a round; ``evaluated``: (round, mean) of the evaluations read with it
        (the one before, where it rode on this round's messages, and this one's own)."""
        if self.progress is None:
            return
        if self.total_rounds == 0:
            mean = evaluated[0][1]
            self.progress(0, 0, "evaluated: " + ("no device answered" if mean is None else f"mean {mean:.2f}"))
            return
        parts = [f"round {server_round}"]
        language = self.job.recipe.is_language_modelling
        label = f"mean {self.job.recipe.data.eval_split} ppl" if language else "mean score"
        for evaluated_round, mean in evaluated:
            if mean is not None:
                after = "" if evaluated_round == server_round else f" after round {evaluated_round}"
                parts.append(f"{label}{after} {mean:.2f}")
        parts.append(f"upload {self._round['bytes_up'] / 1024:.0f} KiB")
        parts.append(f"{time.perf_counter() - self._round['started']:.0f}s")
        if self._round["drops"]:
            parts.append("dropped device " + ", ".join(str(d) for d in self._round["drops"]))
        self.progress(server_round, self.total_rounds, ", ".join(parts))


def _error_reason(code: int, reason: str) -> str:
    """Why a device is dropped, from the error its reply carries."""
    if code == NODE_UNAVAILABLE:
        return "went offline (Flower: its SuperNode stopped or missed its heartbeats)"
    if code in LOST_ON_THE_WAY:
        return f"its reply did not arrive (Flower: {' '.join(reason.split())})"
    return f"raised {device_error(reason)}"


_FLOWER_ERROR = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>:<'(.*)'>", re.DOTALL)


def device_error(reason: str) -> str:
    """A device's error as one line: the exception's type and its whole message (for a
    :class:`UserError`, the problem and its fix), from Flower's ``<class 'T'>:<'message'>``."""
    found = _FLOWER_ERROR.fullmatch(reason.strip())
    kind, text = found.groups() if found else ("", reason)
    lines = [line.strip() for line in text.replace("\\n", "\n").splitlines() if line.strip()]
    message = " ".join(lines) or reason
    return message if kind in ("", UserError.__name__) else f"{kind}: {message}"
