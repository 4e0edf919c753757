"""Flower's own floor for ``small_rounds.py``: rounds of empty messages through its simulation engine.

A ServerApp that, each round, sends every node a ``train`` message carrying ``--payload-kib`` of
zeros and waits for the replies (Flower's own ``Grid.send_and_receive``), and a ClientApp that
answers at once with the same tensor: no model, no data, no toolkit. With the toolkit's default
simulation resources (one CPU per client, so one worker process per core), what a round costs here
is what any app on Flower's simulation engine pays before doing work.

Usage:
    python benchmarks/flower_floor.py --rounds 15 [--nodes 20] [--payload-kib 19]

Prints one JSON object: rounds, nodes and the seconds the simulation took (``simulation_s``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import warnings
from collections.abc import Sequence

import numpy as np
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

server = ServerApp()
client = ClientApp()
ROUNDS_KEY = "FLOWER_FLOOR_ROUNDS"
PAYLOAD_KEY = "FLOWER_FLOOR_PAYLOAD_KIB"


@client.train()
def echo(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)


@server.main()
def rounds(grid: Grid, context: Context) -> None:
    payload = ArrayRecord([np.zeros(int(os.environ[PAYLOAD_KEY]) * 256, dtype=np.float32)])
    nodes = list(grid.get_node_ids())
    while not nodes:  # the simulated nodes register as the simulation starts
        time.sleep(0.01)
        nodes = list(grid.get_node_ids())
    for _ in range(int(os.environ[ROUNDS_KEY])):
        messages = [Message(RecordDict({"arrays": payload}), dst_node_id=node, message_type="train") for node in nodes]
        replies = list(grid.send_and_receive(messages))
        if len(replies) != len(messages) or any(reply.has_error() for reply in replies):
            raise RuntimeError("a node did not answer")


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--payload-kib", type=int, default=19, help="the tensor each message carries, both ways")
    args = parser.parse_args(argv)
    os.environ[ROUNDS_KEY], os.environ[PAYLOAD_KEY] = str(args.rounds), str(args.payload_kib)
    os.environ.pop("RAY_ADDRESS", None)  # Flower's floor as Flower runs it: on a Ray instance of its own
    backend = {"init_args": {"num_cpus": os.cpu_count() or 1, "logging_level": "ERROR", "log_to_driver": False,
                             "include_dashboard": False},
               "client_resources": {"num_cpus": 1, "num_gpus": 0.0}}
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("flwr").setLevel(logging.ERROR)
        run_simulation(server_app=server, client_app=client, num_supernodes=args.nodes, backend_config=backend)
    figures = {"rounds": args.rounds, "nodes": args.nodes, "simulation_s": time.perf_counter() - started}
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
