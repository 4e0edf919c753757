"""What the server pays to learn what each device may upload: from the loaded base (the peer: the
toolkit before it built the reference from the base's config) against from the base's structure
alone, on the meta device (``federation/device.py: upload_reference``), side by side in one run.

Before the first aggregation the server checks every update against a reference of the names,
shapes and dtypes a device may send. Each side builds the reference of device 0 of one method in
a fresh child process (``--measure SIDE``), after importing the runtime:

* **loaded**: the recipe's base model with its weights, then the device's experts on it;
* **structure**: the base built from its config on the meta device, then the same experts.

Reported per side (median of ``--repeats`` children, the sides alternating): seconds to build the
reference, and the child's peak resident memory above what it held before (``VmHWM − VmRSS``); the
ratio is structure ÷ loaded. Both sides must give the same reference (checked).

Usage:
    python benchmarks/server_reference.py [--recipe recipes/demo.yaml] [--method 2] [--repeats 3]
        [--set key=value ...]

``--method`` is an index into the recipe's ``methods``. Prints a table, then (last line) the
figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import harness
import torch

from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.recipe import load_recipe
from ondevice_moe.training import trainable_state

SIDES = ("loaded", "structure")


def options(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/demo.yaml")
    parser.add_argument("--method", type=int, default=2, help="index into the recipe's methods (demo: fedavg)")
    parser.add_argument("--repeats", type=int, default=3, help="child processes per side")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="recipe override key=value")
    parser.add_argument("--measure", choices=SIDES, help=argparse.SUPPRESS)  # in a child
    return parser.parse_args(argv)


def loaded_reference(job: Job, device: int) -> dict[str, torch.Tensor]:
    """The reference from a device model on the loaded base, as the server built it before."""
    model = dev.build_model(job, device)
    names = dev.travelling(job.method, model)
    travelling = {name: tensor for name, tensor in trainable_state(model).items() if name in names}
    return job.method.procedure.upload_reference(travelling)


def signature(reference: dict[str, torch.Tensor]) -> dict[str, list]:
    """Names, shapes and dtypes: what the server checks an update against."""
    return {name: [list(tensor.shape), str(tensor.dtype)] for name, tensor in sorted(reference.items())}


def measure(args: argparse.Namespace) -> dict[str, object]:
    """In a child process: build one side's reference; its time, its added peak memory, its signature."""
    import transformers  # noqa: F401  (the runtime, before the first reading)

    job = Job(load_recipe(args.recipe, args.overrides), args.method, Path("."))
    before = harness.process_status_mib("VmRSS")
    start = time.perf_counter()
    reference = loaded_reference(job, 0) if args.measure == "loaded" else dev.upload_reference(job, 0)
    seconds = time.perf_counter() - start
    added = harness.process_status_mib("VmHWM") - before
    return {"seconds": seconds, "added_peak_mib": added, "method": job.method.name, "signature": signature(reference)}


def _child(argv: Sequence[str], side: str) -> dict[str, object]:
    child = subprocess.run([sys.executable, __file__, *argv, "--measure", side], capture_output=True, text=True,
                           check=False)
    if child.returncode != 0:
        raise SystemExit(f"server_reference: the {side} side failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = options(argv)
    if args.measure:
        print(json.dumps(measure(args)))
        return {}
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for _ in range(args.repeats):
        for side in SIDES:
            runs[side].append(_child(argv, side))
    if runs["loaded"][0]["signature"] != runs["structure"][0]["signature"]:
        raise SystemExit("server_reference: the two sides built different references")
    seconds = {side: statistics.median(run["seconds"] for run in runs[side]) for side in SIDES}
    memory = {side: statistics.median(run["added_peak_mib"] for run in runs[side]) for side in SIDES}
    figures = {"recipe": args.recipe, "method": runs["loaded"][0]["method"], "repeats": args.repeats,
               "tensors": len(runs["loaded"][0]["signature"]), "seconds": seconds, "added_peak_mib": memory,
               "time_ratio": seconds["structure"] / seconds["loaded"],
               "memory_ratio": memory["structure"] / max(memory["loaded"], 1e-9)}
    print(f"{'':24}{'loaded':>12}{'structure':>12}{'ratio':>8}")
    print(f"{'build (s)':24}{seconds['loaded']:12.2f}{seconds['structure']:12.2f}{figures['time_ratio']:8.2f}")
    print(f"{'added peak memory (MiB)':24}{memory['loaded']:12.0f}{memory['structure']:12.0f}"
          f"{figures['memory_ratio']:8.2f}")
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
