"""The peer of ``small_rounds.py``: FedAvg on a small task as a plain PyTorch loop, one process.

The same work as the toolkit's ``fed-ft`` method on a small-model recipe: the same clients and
examples (the task is dealt by :func:`ondevice_moe.data.small.build_small_task` with the recipe's
data seed), the same MLP (64 ReLU units) from the same seed, ``local_epochs`` of shuffled
mini-batches of plain SGD per client and round, the server's average of the clients' weights
weighted by their numbers of examples, and every client's test accuracy every ``eval_every``
rounds and after the last. Nothing else: no messages, no processes, no run folder.

Usage:
    python benchmarks/plain_fedavg.py --rounds 15 [--task digits-dirichlet] [--clients 20]
        [--alpha 0.1] [--batch 16] [--lr 0.1] [--eval-every 5] [--seed 0] [--data-seed 0]

Prints one JSON object: rounds, the mean client accuracy ×100 after the last round, and the
seconds spent in the loop itself (``loop_s``; the process's own wall time is the caller's to take).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import torch
from torch import nn

from ondevice_moe.data.small import TensorExamples, build_small_task


def options(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--task", default="digits-dirichlet")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration of the label skew")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-seed", type=int, default=0)
    return parser.parse_args(argv)


def mlp(inputs: int, hidden: int, outputs: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, outputs))


def local_epochs(model: nn.Module, examples: TensorExamples, args: argparse.Namespace, generator: torch.Generator
                 ) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    for _ in range(args.local_epochs):
        for rows in torch.randperm(len(examples), generator=generator).split(args.batch):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(examples.inputs[rows]), examples.labels[rows]).backward()
            optimizer.step()


@torch.no_grad()
def accuracy(model: nn.Module, examples: TensorExamples) -> float:
    return (model(examples.inputs).argmax(-1) == examples.labels).float().mean().item()


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = options(argv)
    task = build_small_task(args.task, args.clients, args.data_seed, alpha=args.alpha)
    started = time.perf_counter()
    inputs = task.train[0].inputs[0].numel()
    server = mlp(inputs, args.hidden, task.task.num_labels, args.seed)
    client = mlp(inputs, args.hidden, task.task.num_labels, args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    sizes = torch.tensor([len(examples) for examples in task.train], dtype=torch.float32)
    weights = sizes / sizes.sum()
    score = float("nan")
    for round_number in range(1, args.rounds + 1):
        start = {name: tensor.clone() for name, tensor in server.state_dict().items()}
        total = {name: torch.zeros_like(tensor) for name, tensor in start.items()}
        for weight, examples in zip(weights, task.train, strict=True):
            client.load_state_dict(start)
            local_epochs(client, examples, args, generator)
            for name, tensor in client.state_dict().items():
                total[name] += weight * tensor
        server.load_state_dict(total)
        if round_number % args.eval_every == 0 or round_number == args.rounds:
            score = 100 * sum(accuracy(server, examples) for examples in task.test) / len(task.test)
    figures = {"rounds": args.rounds, "mean_accuracy": score, "loop_s": time.perf_counter() - started}
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
