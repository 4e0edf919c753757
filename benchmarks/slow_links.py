"""Rounds on slow uplinks: devices on separate hosts behind a rate-limited link, shared experts sent
as they are (fp32) and as int8, side by side in one run.

A fleet of network namespaces (``ondevice_moe.federation.netns_fleet``): a server, three devices and
the submitting laptop, each its own host. Every device's uplink is limited to ``--mbit`` Mbit/s
with ``tc``'s token bucket; the server's link is not. Each device runs ``ondevice-moe device
--superlink`` (one process, the base model loaded once); the laptop runs ``ondevice-moe finetune
--federation`` with ``federation.transport`` set to each of ``--transports`` in turn, on the same
fleet. From the run's records: per round, the bytes the devices sent and received, the round's
wall time, the busiest device's handler time, and the round's time on the wire (the most one
device's messages spent outside its handler: transfer over its link plus Flower's pacing);
``int8 ÷ fp32`` of each. The link is insecure (no TLS) to keep the setup short; TLS adds its
handshake, not bytes that matter here.

Needs root (network namespaces). Usage:
    sudo python benchmarks/slow_links.py [--recipe recipes/demo.yaml] [--mbit 20] [--rounds R] [--iterations I]
        [--methods fedavg "{name: comigs, variant: 1G1S}"] [--transports fp32 int8] [--set key=value ...]
        [--output runs/slow-links]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import simulations

from ondevice_moe.federation.netns_fleet import NetnsFleet, available
from ondevice_moe.federation.server_runs import RUNS_ENV
from ondevice_moe.recipe import load_recipe
from ondevice_moe.report import MetricsLog

BIN = Path(sys.executable).parent
PORT = 9093
THREE_USERS = ("[{name: code, source: python-code}, {name: news, source: bbc-news}, "
               "{name: reviews, source: rotten-tomatoes}]")


def options(argv: Sequence[str] | None):
    parser = simulations.parser(__doc__, "slow-links")
    parser.add_argument("--mbit", type=float, default=20.0, help="each device's uplink, Mbit/s")
    parser.add_argument("--methods", nargs="+", default=["fedavg", "{name: comigs, variant: 1G1S}"],
                        help="method entries, as in a recipe")
    parser.add_argument("--transports", nargs="+", default=["fp32", "int8"], help="federation.transport values")
    parser.add_argument("--users", default=THREE_USERS, help="data.users: one device each")
    return parser.parse_args(argv)


def environment(folder: Path) -> dict[str, str]:
    """A host's process: its own home; the model cache of the user running the benchmark (converted once)."""
    cache = os.environ.get("ONDEVICE_MOE_CACHE") or str(Path.home() / ".cache" / "ondevice-moe")
    return {"HOME": str(folder / "home"), "FLWR_HOME": str(folder / "home" / ".flwr"), "ONDEVICE_MOE_CACHE": cache,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
            "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}


def finetune_command(args, transport: str) -> list[str]:
    command = [str(BIN / "ondevice-moe"), "finetune", str(args.recipe.resolve()), "--federation", "bench",
               "--output", f"runs/{transport}", "--set", f"methods=[{', '.join(args.methods)}]",
               "--set", f"data.users={args.users}", "--set", f"federation.transport={transport}"]
    sizes = [f"federation.rounds={args.rounds}"] if args.rounds else []
    sizes += [f"federation.local_iterations={args.iterations}"] if args.iterations else []
    for override in [*args.overrides, *sizes]:
        command += ["--set", override]
    return command


def run_all(args, devices: int) -> dict[str, dict]:
    """Every transport on one fleet; the figures of each method under each transport."""
    hosts = ["server", *(f"device{index}" for index in range(devices)), "laptop"]
    with tempfile.TemporaryDirectory(prefix="ondevice-moe-slow-links-") as folder:
        fleet = NetnsFleet(Path(folder), hosts).up()
        try:
            server, laptop = fleet.folder("server"), fleet.folder("laptop")
            fleet.start("server", "superlink", [str(BIN / "flower-superlink"), "--host", "0.0.0.0", "--port",
                                                str(PORT), "--database", "state.db", "--insecure",
                                                "--disable-runtime-dependency-installation"],
                        {**environment(server), RUNS_ENV: str(server / "runs")})
            flwr_home = laptop / "home" / ".flwr"
            flwr_home.mkdir(parents=True)
            (flwr_home / "config.toml").write_text(f'[superlink.bench]\naddress = "{fleet.address("server")}:{PORT}"\n'
                                                   "insecure = true\n")
            for index in range(devices):
                host = f"device{index}"
                fleet.rate_limit(host, args.mbit)
                fleet.start(host, "device", [str(BIN / "ondevice-moe"), "device", "--superlink",
                                             f"{fleet.address('server')}:{PORT}", "--insecure", "--node-config",
                                             f'partition-id={index} state-dir="{fleet.folder(host) / "state"}"'],
                            environment(fleet.folder(host)))
            figures = {}
            for transport in args.transports:
                started = time.perf_counter()
                done = fleet.run("laptop", finetune_command(args, transport), environment(laptop), timeout=7200)
                if done.returncode != 0:
                    raise SystemExit(f"the {transport} run failed:\n{(done.stdout + done.stderr)[-3000:]}")
                figures[transport] = measured(laptop / "runs" / transport, time.perf_counter() - started)
            return figures
        finally:
            fleet.down()


def measured(run: Path, command_s: float) -> dict[str, object]:
    """Per method: the mean per round of its bytes, wall time, busiest handler and time on the wire."""
    records = MetricsLog(run / "metrics.jsonl").read()
    summary = json.loads((run / "summary.json").read_text())
    figures: dict[str, object] = {"command_s": command_s}
    for method in summary["methods"]:
        rounds = [r for r in records if r["method"] == method and r["kind"] == "round"]
        comm = [r for r in records if r["method"] == method and r["kind"] == "comm"]
        figures[method] = {
            "bytes_up": statistics.fmean(r["bytes_up"] for r in comm),
            "bytes_down": statistics.fmean(r["bytes_down"] for r in comm),
            "round_wall_s": statistics.fmean(r["wall_s"] for r in rounds),
            "busiest_s": statistics.fmean(r["busiest_worker_s"] for r in rounds),
            "wire_s": statistics.fmean(r["wire_s"] for r in rounds),
            "mean_in": summary["methods"][method].get("mean_in")}
    return figures


def markdown(figures: dict[str, dict], mbit: float) -> str:
    transports = list(figures)
    lines = [f"Device uplinks at {mbit:g} Mbit/s; per round, all devices together; wire: the slowest device's "
             "time outside its handler.", "",
             "| method | transport | up (MB) | down (MB) | round wall (s) | busiest handler (s) | wire (s) | "
             "mean in-dist ppl | wall ÷ first | wire ÷ first |", "|---|---|---|---|---|---|---|---|---|---|"]
    methods = [name for name in figures[transports[0]] if name != "command_s"]
    for method in methods:
        first = figures[transports[0]][method]
        for transport in transports:
            f = figures[transport][method]
            lines.append(f"| {method} | {transport} | {f['bytes_up'] / 1e6:.2f} | {f['bytes_down'] / 1e6:.2f} | "
                         f"{f['round_wall_s']:.1f} | {f['busiest_s']:.1f} | {f['wire_s']:.1f} | "
                         f"{f['mean_in']:.2f} | {f['round_wall_s'] / first['round_wall_s']:.2f} | "
                         f"{f['wire_s'] / first['wire_s']:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    args = options(argv)
    problem = available()
    if problem:
        raise SystemExit(f"error: {problem}\nfix: run it as root on Linux with iproute2 installed")
    devices = len(load_recipe(args.recipe, [*args.overrides, f"data.users={args.users}"]).user_names)
    args.output.mkdir(parents=True, exist_ok=True)
    figures = run_all(args, devices)
    return simulations.publish(args.output, "slow_links", figures, markdown(figures, args.mbit))


if __name__ == "__main__":
    main()
