"""Secure aggregation with Flower's SecAgg+ (recipe ``federation.secure_aggregation: secaggplus``).

SecAgg+ (Bell et al., 2020, "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead") lets the server learn only the weighted sum of the devices' vectors: each
device quantizes its upload into an integer ring, adds pairwise masks agreed with its
neighbours and a private mask, and the server removes the masks once enough devices
returned shares of the secrets (the dropped devices' pairwise masks too).

Flower 1.41 implements the protocol in two pieces, used here unchanged:

* ``flwr.client.mod.secaggplus_mod`` (``flwr/client/mod/secure_aggregation/secaggplus_mod.py``)
  on the device, wrapped by :func:`secure_aggregation_mod`;
* ``flwr.server.workflow.SecAggPlusWorkflow`` (``flwr/server/workflow/secure_aggregation/
  secaggplus_workflow.py``) on the server. It exists only for the legacy API:
  ``__call__`` demands a ``LegacyContext`` (lines 183–189), takes its messages from the
  legacy ``Strategy.configure_fit`` (line 286) and hands the unmasked sum to the legacy
  ``aggregate_fit`` (line 665); a Message-API ``Strategy`` has no place for its four
  round trips. :func:`secure_round` therefore runs the workflow itself, through the run's
  ``Grid``, with a ``LegacyContext`` whose strategy (:class:`_Relay`) hands out
  :class:`~ondevice_moe.federation.strategy.SlotStrategy`'s training messages as ``FitIns``
  and keeps what ``aggregate_fit`` receives. ``SlotStrategy.configure_train`` calls it,
  where Flower hands the strategy the ``Grid``, and returns no further messages.

What the server learns is Σ_i w_i x_i / Σ_i w_i over the devices that finished, x_i a
device's shared tensors and w_i its weight (1 under ``weighting: uniform``, its example
count under ``num_examples``, bounded by ``secaggplus.max_weight``): FedAvg's and CoMiGS's
rule (Alg. 1 line 498), within the quantization step ``2·clipping_range / quantization_range``
per coordinate, after clipping each value to ±``clipping_range``. Flower quantizes by
stochastic rounding from NumPy's global generator, so reruns agree only within that step.
The server cannot check one device's update (it never sees one), so a corrupted upload
is not dropped: recipes with ``nan``/``wrong-shape`` faults are refused.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import flwr.compat.common.recorddict_compat as compat
import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

from ondevice_moe.federation.job import job_from_context
from ondevice_moe.federation.wire import unpack
from ondevice_moe.recipe import FederationSection

# Legacy FitIns carry unnamed arrays and scalar configs only: these name lists travel as one
# newline-separated string each.
SENT_KEY = "secaggplus-sent"  # the names of the tensors the server sent, in FitIns order
UPLOAD_KEY = "secaggplus-upload"  # the names the device uploads, in the order they are summed
LIST_PREFIX = "list:"  # a list-valued metric (a device's step losses) as JSON text: Flower's FitRes takes scalars only


# -- server -------------------------------------------------------------------


@dataclass
class SecureRound:
    """What one SecAgg+ round leaves the server: the weighted mean (``None`` when the
    protocol halted), each finishing device's train metrics, and the bytes each node
    sent (``bytes_up``: all four stages) and its masked tensors' bytes by name."""

    mean: dict[str, torch.Tensor] | None
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    bytes_up: Counter[int] = field(default_factory=Counter)
    masked_bytes: dict[int, dict[str, int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


class _Relay(LegacyStrategy):
    """The legacy strategy ``SecAggPlusWorkflow`` drives: it hands out the round's training
    messages and keeps the results ``aggregate_fit`` receives (each with the unmasked mean as
    its parameters). The last four methods are abstract in Flower's legacy ``Strategy``;
    the workflow never calls them."""

    def __init__(self, instructions: list[tuple[ClientProxy, FitIns]]) -> None:
        self.instructions = instructions
        self.results: list[tuple[ClientProxy, FitRes]] | None = None
        self.failures: list[Any] = []

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        return self.instructions

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[Any]) -> tuple[None, dict[str, Any]]:
        self.results, self.failures = results, failures
        return None, {}

    def initialize_parameters(self, client_manager: ClientManager) -> None:
        return None

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[Any]:
        return []

    def aggregate_evaluate(self, server_round: int, results: list[Any], failures: list[Any]) -> tuple[None, dict]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> None:
        return None


class _CountingGrid:
    """The run's ``Grid``, counting the bytes of every node's replies and the sizes of its
    masked tensors (``SecAggPlusWorkflow`` only calls ``send_and_receive``)."""

    def __init__(self, grid: Grid, names: list[str]) -> None:
        self.grid = grid
        self.names = names
        self.bytes_up: Counter[int] = Counter()
        self.masked_bytes: dict[int, dict[str, int]] = {}

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        for reply in replies:
            if reply.has_error():
                continue
            node = reply.metadata.src_node_id
            self.bytes_up[node] += sum(_config_bytes(record) if isinstance(record, ConfigRecord) else
                                       record.count_bytes() for record in reply.content.values())
            configs = reply.content.config_records.get(RECORD_KEY_CONFIGS, {})
            if SecAggKey.MASKED_PARAMETERS in configs:  # the weight factor first, then the tensors
                sizes = [len(b) for b in configs[SecAggKey.MASKED_PARAMETERS]][1:]
                self.masked_bytes[node] = dict(zip(self.names, sizes, strict=True))
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)


def _config_bytes(record: ConfigRecord) -> int:
    """``ConfigRecord.count_bytes`` as Flower counts (8 per number, 1 per bool, the length of
    bytes and strings), where Flower's raises on an empty string (the status message of a FitRes)."""
    def size(value: Any) -> int:
        return len(value) if isinstance(value, (str, bytes)) else 1 if isinstance(value, bool) else 8

    return sum(sum(map(size, value)) if isinstance(value, list) else size(value) for value in record.values())


def secure_round(grid: Grid, messages: dict[int, Message], reference: dict[str, torch.Tensor],
                 federation: FederationSection, server_round: int) -> SecureRound:
    """Run one training round under Flower's SecAgg+ through ``grid``: ``messages`` are the
    round's training messages by node id, ``reference`` the names, shapes and dtypes every
    device uploads. Returns the mean in ``reference``'s dtypes, by name."""
    names = sorted(reference)
    instructions = []
    for node, message in messages.items():
        arrays = unpack(message.content["arrays"])
        sent = sorted(arrays)
        config = {**message.content["config"], SENT_KEY: "\n".join(sent), UPLOAD_KEY: "\n".join(names)}
        parameters = ndarrays_to_parameters([arrays[name].numpy() for name in sent])
        instructions.append((GridClientProxy(node, grid, grid.run.run_id), FitIns(parameters, config)))
    relay = _Relay(instructions)
    state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: server_round}),
                        MAIN_PARAMS_RECORD: ArrayRecord()})
    context = LegacyContext(Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=state, run_config={}),
                            strategy=relay)
    section = federation.secaggplus
    max_weight = section.max_weight if federation.weighting == "num_examples" else 1.0
    workflow = SecAggPlusWorkflow(section.num_shares, section.reconstruction_threshold, max_weight=max_weight,
                                  clipping_range=section.clipping_range,
                                  quantization_range=section.quantization_range,
                                  timeout=federation.reply_timeout_s)
    counting = _CountingGrid(grid, names)
    workflow(counting, context)
    failures = [str(failure) for failure in relay.failures]
    if relay.results is None:
        return SecureRound(None, bytes_up=counting.bytes_up, failures=failures)
    metrics = {proxy.node_id: _unpack_lists(fitres.metrics) for proxy, fitres in relay.results}
    arrays = parameters_to_ndarrays(relay.results[0][1].parameters) if relay.results else []
    mean = {name: torch.from_numpy(np.asarray(array)).reshape(reference[name].shape).to(reference[name].dtype)
            for name, array in zip(names, arrays, strict=True)}
    return SecureRound(mean, metrics, counting.bytes_up, counting.masked_bytes, failures)


def _pack_lists(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A device's metrics as FitRes takes them: each list as JSON text under :data:`LIST_PREFIX`."""
    packed: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, list):
            packed[f"{LIST_PREFIX}{key}"] = json.dumps(value)
        else:
            packed[key] = value
    return packed


def _unpack_lists(metrics: dict[str, Any]) -> dict[str, Any]:
    """A device's FitRes metrics with its lists restored (:data:`LIST_PREFIX`), ``device`` left out."""
    return {key.removeprefix(LIST_PREFIX): json.loads(value) if key.startswith(LIST_PREFIX) else value
            for key, value in metrics.items() if key != "device"}


# -- device -------------------------------------------------------------------


def secure_aggregation_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """A Flower ``Mod``: SecAgg+'s four stages through Flower's ``secaggplus_mod``; its
    training stage runs the ClientApp's handler (and the mods inside this one) on the
    message it would receive without secure aggregation, and sums the upload's tensors in
    the order the server names. Messages without SecAgg+ configs pass untouched."""
    if RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, context)

    def train(msg: Message, context: Context) -> Message:
        config = dict(msg.content["fitins.config"])
        sent, names = (str(config.pop(key)).split("\n") if config[key] else [] for key in (SENT_KEY, UPLOAD_KEY))
        parameters = compat.arrayrecord_to_parameters(msg.content["fitins.parameters"], keep_input=True)
        arrays = {name: Array(array) for name, array in zip(sent, parameters_to_ndarrays(parameters), strict=True)}
        msg.content = RecordDict({"arrays": ArrayRecord(arrays),
                                  "config": ConfigRecord(config)})
        reply = call_next(msg, context)
        if reply.has_error():
            raise RuntimeError(reply.error.reason)
        metrics = _pack_lists(reply.content["metrics"])
        upload = unpack(reply.content["arrays"])
        weighting = job_from_context(context).recipe.federation.weighting
        weight = int(metrics["num-examples"]) if weighting == "num_examples" else 1
        fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([upload[name].numpy() for name in names]),
                        weight, metrics)
        return Message(compat.fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)

    return secaggplus_mod(msg, context, train)
