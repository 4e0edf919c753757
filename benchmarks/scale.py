"""Peak memory of a federation of many clients: 100 devices against 10, side by side in one run.

Runs the recipe (default ``recipes/demo.yaml``: SmolLM2-135M, four users' domains) with
``data.clients: N`` (N devices dealt over the users' domains in turn, each with its own sample
of its domain) and ``federation.fraction_train: F`` for each N of ``--clients`` (default 10 100)
and each ``--device-state`` (default ``memory disk``: where a device keeps its private
tensors and optimiser state between rounds), each a real Flower simulation run afresh in a
child process. Its whole process tree (the driver: Flower's server and simulation engine;
Ray's GCS, raylet and agents; Ray's worker processes) is sampled from ``/proc`` every
``--interval`` seconds:

* **peak PSS**: the largest sum, at one sample, of the tree's proportional set sizes (pages
  shared between processes, such as libraries and Ray's object store, divided among them, so
  counted once): the run's peak resident memory, and the figure the goal is checked on;
* **sum of VmHWM**: each process's own peak resident set, summed: an upper bound (the peaks
  need not coincide, and shared pages count in every process).

Reported per device-state kind: the ratio of the largest N to the smallest (goal: ≤ 1.2).

The same *fraction* trains each round (default 10 %: 1 of 10 devices, 10 of 100): "the same
run with 10 clients" is the same recipe, so the 100-client run trains ten times the devices
per round and ends holding the state of ten times as many trained devices; the harder of the
two comparisons. ``--per-round K`` trains K devices per round at every N instead
(``federation.clients_per_round``), which isolates what idle devices cost.

Usage:
    python benchmarks/scale.py [--recipe recipes/demo.yaml] [--clients 10 100] [--fraction 0.1 | --per-round K]
        [--device-state memory disk] [--methods "{name: comigs, variant: 1G1S}"] [--rounds R] [--iterations I]
        [--set key=value ...] [--output runs/scale-benchmark]

Writes ``scale.json`` and ``scale.md`` under ``--output``; prints the table, then (last line)
the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import simulations

from ondevice_moe.federation.ray_cluster import own_instance_environment

GOAL = 1.2
METHODS = ["{name: comigs, variant: 1G1S}"]


def options(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = simulations.parser(__doc__, "scale-benchmark")
    parser.add_argument("--clients", nargs="+", type=int, default=[10, 100], help="device counts to compare")
    sampling = parser.add_mutually_exclusive_group()
    sampling.add_argument("--fraction", type=float, default=0.1, help="federation.fraction_train at every N")
    sampling.add_argument("--per-round", type=int, help="federation.clients_per_round at every N instead")
    parser.add_argument("--device-state", nargs="+", default=["memory", "disk"], choices=["memory", "disk"],
                        help="federation.device_state kinds to compare")
    parser.add_argument("--methods", nargs="+", default=METHODS, help="method entries, as in a recipe")
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between memory samples")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # CLIENTS:KIND: run one variant (the child)
    return parser.parse_args(argv)


def label_of(clients: int, kind: str) -> str:
    return f"{clients}-clients-{kind}"


def overrides_of(args: argparse.Namespace, clients: int, kind: str) -> list[str]:
    sampling = (f"federation.clients_per_round={args.per_round}" if args.per_round
                else f"federation.fraction_train={args.fraction}")
    return [f"methods=[{', '.join(args.methods)}]", f"data.clients={clients}", sampling,
            f"federation.device_state={kind}"]


def run_child(args: argparse.Namespace) -> None:
    """The child's part: run one variant (in this process, its Ray processes below it)."""
    clients, kind = args.variant.split(":")
    simulations.run_variant(args, label_of(int(clients), kind), overrides_of(args, int(clients), kind))


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, pending = [], [root]
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending.extend(children.get(pid, []))
    return found


def _field_kib(path: str, field: str) -> int:
    """A ``<field>: <n> kB`` line of a /proc file, or 0 once the process has gone."""
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def role_of(pid: int, root: int) -> str:
    """What a process of the tree is: ``driver`` (the run), ``workers`` (Ray's actors serving
    the devices), or the name of one of Ray's own processes (``gcs_server``, ``raylet``, ...)."""
    if pid == root:
        return "driver"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    words = [w.decode(errors="replace") for w in argv if w]
    if any(w.startswith("ray::") for w in words):
        return "workers"
    script = next((w for w in words[1:] if w.endswith(".py")), words[0] if words else "?")
    return Path(script).name


def measure(command: list[str], interval: float) -> dict[str, object]:
    """Run ``command``; peak summed PSS of its process tree and its split by process role at
    that moment, summed per-process VmHWM (MiB), wall time."""
    start = time.perf_counter()
    path = os.pathsep.join(p for p in (str(simulations.ROOT), os.environ.get("PYTHONPATH")) if p)
    child = subprocess.Popen(command, env={**own_instance_environment(), "PYTHONPATH": path})
    peak_pss, at_peak = 0, {}
    hwm: dict[int, int] = {}
    while child.poll() is None:
        pss = {pid: _field_kib(f"/proc/{pid}/smaps_rollup", "Pss") for pid in process_tree(child.pid)}
        total = sum(pss.values())
        if total > peak_pss:
            peak_pss, at_peak = total, {}
            for pid, kib in pss.items():
                role = role_of(pid, child.pid)
                at_peak[role] = at_peak.get(role, 0) + kib / 1024
        for pid in pss:
            hwm[pid] = max(hwm.get(pid, 0), _field_kib(f"/proc/{pid}/status", "VmHWM"))
        time.sleep(interval)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed with exit status {child.returncode}")
    return {"peak_pss_mib": peak_pss / 1024, "peak_pss_by_role_mib": at_peak,
            "sum_vmhwm_mib": sum(hwm.values()) / 1024, "processes": len(hwm), "wall_s": time.perf_counter() - start}


def trained_devices(run_dir: Path) -> int:
    """How many distinct devices trained in the run (and so hold private state)."""
    from ondevice_moe.report import MetricsLog

    return len({r["user"] for r in MetricsLog(run_dir / "metrics.jsonl").read() if r["kind"] == "train"})


def run_all(args: argparse.Namespace, argv: list[str]) -> dict[str, dict]:
    """Each variant, afresh (the memory of a resumed run would not be the run's), measured from outside."""
    variants = {}
    for kind in args.device_state:
        for clients in args.clients:
            label = label_of(clients, kind)
            shutil.rmtree(args.output / label, ignore_errors=True)
            command = [sys.executable, str(Path(__file__).resolve()), *argv, "--variant", f"{clients}:{kind}"]
            variants[label] = {"clients": clients, "device_state": kind, **measure(command, args.interval),
                               "trained_devices": trained_devices(args.output / label)}
    return variants


def figures_of(args: argparse.Namespace, variants: dict[str, dict]) -> dict[str, object]:
    """The variants and, per device-state kind, the largest N's figures over the smallest N's."""
    low, high = min(args.clients), max(args.clients)
    ratios = {kind: {figure: variants[label_of(high, kind)][figure] / variants[label_of(low, kind)][figure]
                     for figure in ("peak_pss_mib", "sum_vmhwm_mib")} for kind in args.device_state}
    sampling = f"{args.per_round} per round" if args.per_round else f"fraction {args.fraction:g} per round"
    return {"variants": variants, "ratio": ratios, "compared": f"{high} vs {low} clients", "sampling": sampling,
            "goal": GOAL}


def table(figures: dict) -> str:
    lines = ["| variant | devices trained | peak PSS (MiB) | sum of VmHWM (MiB) | processes | wall (s) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {label} | {v['trained_devices']} | {v['peak_pss_mib']:.0f} | {v['sum_vmhwm_mib']:.0f} | "
              f"{v['processes']} | {v['wall_s']:.0f} |" for label, v in figures["variants"].items()]
    lines += ["", "Peak PSS split by process at the moment of the peak (MiB):", ""]
    roles = sorted({role for v in figures["variants"].values() for role in v["peak_pss_by_role_mib"]},
                   key=lambda role: (role not in ("driver", "workers"), role))
    lines += [f"| variant | {' | '.join(roles)} |", "|---|" + "---|" * len(roles)]
    lines += [f"| {label} | " + " | ".join(f"{v['peak_pss_by_role_mib'].get(role, 0):.0f}" for role in roles) + " |"
              for label, v in figures["variants"].items()]
    lines.append("")
    for kind, ratio in figures["ratio"].items():
        verdict = "within" if ratio["peak_pss_mib"] <= GOAL else "over"
        lines.append(f"device_state {kind}, {figures['compared']} ({figures['sampling']}): peak PSS ×"
                     f"{ratio['peak_pss_mib']:.3f} ({verdict} the ×{GOAL} goal), sum of VmHWM ×"
                     f"{ratio['sum_vmhwm_mib']:.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, object] | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = options(argv)
    if args.variant:
        run_child(args)
        return None
    figures = figures_of(args, run_all(args, argv))
    markdown = table(figures)
    return simulations.publish(args.output, "scale", figures, markdown)


if __name__ == "__main__":
    main()
