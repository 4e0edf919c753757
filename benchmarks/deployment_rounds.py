"""What a round costs on real devices against the simulation, side by side in one run.

The same recipe and methods run three ways, each into its own folder under ``--output``:

* ``simulation``: ``ondevice-moe finetune`` (Flower's simulation engine, Ray workers);
* ``deployment``: a ``flower-superlink`` and one ``flower-supernode`` per device on localhost
  (``ondevice_moe.federation.localhost``), submitted with ``ondevice-moe finetune --federation``;
  Flower's default isolation starts one ``flwr-clientapp`` process per message;
* ``deployment + device``: the same with ``--isolation process`` and one ``ondevice-moe device``
  process per device, which runs every message of its device; a round's evaluation rides on the
  next round's training messages (``federation.evaluation_rides``, the default on real devices);
* ``deployment + device, evaluation apart``: the same with every evaluation in an exchange of its
  own (``--set federation.evaluation_rides=false``), two exchanges a round, as Flower's strategies run.

From each run's ``round`` records: the mean wall time of a round, the busiest process's handler
time, the overhead ``(wall − busiest) ÷ wall`` and ``wall ÷ busiest − 1`` (the same fact, as a share
of the work rather than of the wall), the round's time on the wire (real devices only), the processes
that served a round (``workers``), the most base-model loads of one process, the whole command's wall
time (start-up included) and the mean in-distribution result, which must agree between the three.

Usage:
    python benchmarks/deployment_rounds.py [--recipe tests/recipes/tiny.yaml] [--rounds R] [--iterations I]
        [--methods fedavg ...] [--set key=value ...] [--output runs/deployment-rounds]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import simulations

from ondevice_moe.federation.localhost import LocalFederation, environment
from ondevice_moe.recipe import load_recipe
from ondevice_moe.report import MetricsLog

DEVICE = "deployment + device"
APART = "deployment + device, evaluation apart"
MODES = ("simulation", "deployment", DEVICE, APART)
CONNECTION = "local-benchmark"


def options(argv: Sequence[str] | None):
    parser = simulations.parser(__doc__, "deployment-rounds")
    parser.set_defaults(recipe=simulations.ROOT / "tests" / "recipes" / "tiny.yaml")
    parser.add_argument("--methods", nargs="+", default=["fedavg"], help="method entries, as in a recipe")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES[:3]), help="which ways to run it")
    return parser.parse_args(argv)


def finetune_command(args, output: Path, federation: str | None, mode: str) -> list[str]:
    command = [str(Path(sys.executable).with_name("ondevice-moe")), "finetune", str(args.recipe),
               "--output", str(output), "--set", f"methods=[{', '.join(args.methods)}]"]
    sizes = [f"federation.rounds={args.rounds}"] if args.rounds else []
    sizes += [f"federation.local_iterations={args.iterations}"] if args.iterations else []
    sizes += ["federation.evaluation_rides=false"] if mode == APART else []
    for override in [*args.overrides, *sizes]:
        command += ["--set", override]
    return command + (["--federation", federation] if federation else [])


def finetune(command: list[str], mode: str, output: Path, env: dict[str, str] | None = None) -> None:
    """Run ``command``; if it fails, stop the benchmark with what it said from its first ``error:``
    line on (or the method's error in the run folder), not a traceback."""
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode == 0:
        return
    said = (done.stdout + done.stderr).splitlines()
    start = next((i for i, line in enumerate(said) if line.startswith("error:")), None)
    log = output / "metrics.jsonl"
    errors = [r["message"] for r in MetricsLog(log).read() if r["kind"] == "error"] if log.exists() else []
    reason = ("\n".join(said[start:start + 12]) if start is not None
              else f"error: {errors[-1]}" if errors else f"error: exit status {done.returncode}")
    raise SystemExit(f"{reason}\n(the {mode} run; its folder: {output})")


def run_mode(args, mode: str, devices: int) -> dict[str, object]:
    """Run the recipe one way; its timing and results from the run folder."""
    output = args.output / mode.replace(" + ", "-").replace(", ", "-").replace(" ", "-")
    started = time.perf_counter()
    if mode == "simulation":
        finetune(finetune_command(args, output, None, mode), mode, output)
    else:
        with tempfile.TemporaryDirectory(prefix="ondevice-moe-deployment-") as folder:
            federation = LocalFederation(Path(folder))
            try:
                federation.start_superlink()
                for device in range(devices):
                    federation.start_supernode(device, None, warm=mode.startswith(DEVICE))
                federation.connection_config(Path(folder) / "cli", CONNECTION)
                finetune(finetune_command(args, output, CONNECTION, mode), mode, output,
                         environment(Path(folder) / "cli"))
            finally:
                federation.stop()
    wall = time.perf_counter() - started
    records = MetricsLog(output / "metrics.jsonl").read()
    rounds = [r for r in records if r["kind"] == "round"]
    summary = json.loads((output / "summary.json").read_text())
    return {"command_s": wall, "round_wall_s": statistics.fmean(r["wall_s"] for r in rounds),
            "busiest_worker_s": statistics.fmean(r["busiest_worker_s"] for r in rounds),
            "overhead": statistics.fmean(r["overhead"] for r in rounds),
            "over_busiest": statistics.fmean(r["wall_s"] / r["busiest_worker_s"] - 1 for r in rounds),
            "wire_s": statistics.fmean(r["wire_s"] for r in rounds) if all(r.get("wire_s") is not None
                                                                           for r in rounds) else None,
            "workers_per_round": statistics.fmean(r["workers"] for r in rounds),
            "base_loads": max(r["base_loads"] for r in rounds),
            "mean_in": {name: method["mean_in"] if "mean_in" in method else method.get("mean_score")
                        for name, method in summary["methods"].items()}}


def markdown(figures: dict[str, dict]) -> str:
    simulation = figures.get("simulation", {}).get("round_wall_s")
    lines = ["| mode | round wall (s) | × simulation | busiest process (s) | overhead | wall ÷ busiest − 1 | "
             "wire (s) | processes per round | base loads per process | command (s) | mean in-dist |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, f in figures.items():
        results = ", ".join(f"{name} {value:.2f}" for name, value in f["mean_in"].items())
        ratio = f"{f['round_wall_s'] / simulation:.2f}" if simulation else "—"
        wire = f"{f['wire_s']:.1f}" if f.get("wire_s") is not None else "—"
        lines.append(f"| {mode} | {f['round_wall_s']:.1f} | {ratio} | "
                     f"{f['busiest_worker_s']:.2f} | {f['overhead']:.2f} | {100 * f['over_busiest']:.0f} % | {wire} | "
                     f"{f['workers_per_round']:.1f} | {f['base_loads']} | {f['command_s']:.0f} | {results} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    args = options(argv)
    devices = len(load_recipe(args.recipe, args.overrides).user_names)
    figures = {mode: run_mode(args, mode, devices) for mode in args.modes}
    return simulations.publish(args.output, "deployment_rounds", figures, markdown(figures))


if __name__ == "__main__":
    main()
