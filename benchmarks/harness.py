"""What the client benchmarks share: options, a PEFT LoRA peer, timing and memory.

Step time: every configuration is built in one process and their steps
alternate (A B, B A, A B, …), so a shared or throttled machine slows both
sides alike; the figures are medians after one warm-up step each.
Peak memory: each configuration runs in a fresh child process (the calling
script with ``--measure-memory KIND``), so its peak is its own: peak resident
set size (``VmHWM``) on the CPU, peak allocated memory on CUDA; and on the CPU
also the peak of live tensors (``tensor_peak.py``), which leaves out what the
allocator holds and what the process maps without touching.
On the CPU the children run with glibc's mmap threshold fixed at 1 MiB
(``MALLOC_MMAP_THRESHOLD_``): by default glibc raises the threshold after
each large free, so later activations come from the heap, and the peak then
depends on the order of frees (the same run measured 2.7 to 3.4 GiB).
With the threshold fixed, large tensors go back to the system when freed and
the peak is the program's, stable to a few MiB between runs.
``--threads N`` pins torch's CPU threads: on a machine shared with other
jobs, oversubscribed threads penalise the side with more (small) operations.
``--compile`` adds both sides again under ``torch.compile`` (each on its own
copy of the base), their first step (which compiles) timed apart, and prints
the compiled step times and ratios beside the eager ones. ``--fused`` adds our
side again with its expert sites fused (``training.fused_experts``,
``ondevice_moe/layout/fused.py``): its step time and peak memory beside the
peer's and beside our unfused side's. ``--profile`` profiles one more step of each
side with ``torch.profiler`` and prints, per operator, the self time of each side
and our side's excess over the peer's, largest first: where the gap goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tensor_peak import peak_tensor_mib
from torch import nn

from ondevice_moe.layout.fused import fuse_experts
from ondevice_moe.models import load_base_model
from ondevice_moe.models.devices import DEVICE_NAMES, resolve_device
from ondevice_moe.training import DeviceTrainer

Step = Callable[[], None]
CHILD_ENVIRONMENT = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}


@dataclass
class Configuration:
    """One side of a comparison: its training step, its number of adapter (expert) parameters and the
    module its step calls (what ``--compile`` hands to ``torch.compile``)."""

    step: Step
    adapter_params: int
    model: nn.Module


def parser(description: str, default_model: str = "smollm2-135m") -> argparse.ArgumentParser:
    """The options every client benchmark takes."""
    options = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--model", default=default_model, help="model alias (tiny-llama / tiny-gpt2 for a smoke run)")
    options.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    options.add_argument("--device", default="auto", choices=DEVICE_NAMES, help="auto: CUDA when available")
    options.add_argument("--batch", type=int, default=4)
    options.add_argument("--context", type=int, default=128)
    options.add_argument("--steps", type=int, default=5, help="timed steps per configuration, after one warm-up")
    options.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    options.add_argument("--compile", action="store_true",
                         help="also time both sides under torch.compile (each on its own copy of the base)")
    options.add_argument("--fused", action="store_true",
                         help="also time our side with its experts fused (training.fused_experts)")
    options.add_argument("--profile", action="store_true",
                         help="also profile one step of each side: self time per operator, side by side")
    options.add_argument("--measure-memory", metavar="KIND", help=argparse.SUPPRESS)
    return options


def batch_of(args: argparse.Namespace, vocab_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A fixed random language-modelling batch (labels = inputs)."""
    tokens = torch.randint(0, vocab_size, (args.batch, args.context), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(device)
    return {"input_ids": tokens, "labels": tokens}


def load(args: argparse.Namespace):
    """The frozen base model on the resolved device (with ``--threads`` applied)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return load_base_model(args.model, args.dtype, device=resolve_device(args.device))


def trainer_configuration(trainer: DeviceTrainer, batch: dict[str, torch.Tensor]) -> Configuration:
    """A device of this harness: one expert step of its local procedure."""
    return Configuration(lambda: trainer.expert_step(batch), sum(p.numel() for p in trainer.expert_parameters()),
                         trainer.model)


def peft_lora_configuration(model: nn.Module, targets: Sequence[str], batch: dict[str, torch.Tensor], *,
                            rank: int = 8, alpha: float = 16.0, rank_stabilised: bool = True,
                            rank_pattern: dict[str, int] | None = None, grad_clip: float = 1.0,
                            lr: float = 2e-3) -> Configuration:
    """Plain HF PEFT LoRA on ``model`` (modified in place), trained like a
    Hugging Face ``Trainer`` would: AdamW, gradients clipped at norm 1."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rank_stabilised, target_modules=list(targets),
                        rank_pattern=rank_pattern or {}, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)

    def step() -> None:
        peft_model.train()
        loss = peft_model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()

    return Configuration(step, sum(p.numel() for p in params), peft_model)


def interleaved_step_times(configurations: dict[str, Configuration], steps: int, device: torch.device
                           ) -> dict[str, float]:
    """Median step time of each configuration, their steps alternating in one process."""
    names = list(configurations)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(steps + 1):
        for name in names if round_index % 2 == 0 else reversed(names):
            start = _clock(device)
            configurations[name].step()
            if round_index > 0:  # round 0 is the warm-up
                times[name].append(_clock(device) - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def measure_memory(build: Callable[[], Configuration], device: torch.device) -> dict[str, float]:
    """In a child process: build one configuration and run two steps; its peak memory in MiB.

    ``tensor_peak_mib``: the peak of live tensors (a third step, :mod:`tensor_peak`, on the CPU;
    CUDA's peak allocated memory, which counts the same, on CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = _resident_mib(device)
    configuration = build()
    loaded = _resident_mib(device)
    for _ in range(2):
        configuration.step()
    peak = _peak_mib(device)
    tensors = peak if device.type == "cuda" else peak_tensor_mib(configuration.step)
    return {"peak_mib": peak, "training_mib": peak - loaded, "model_mib": loaded - before, "tensor_peak_mib": tensors}


def _resident_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    return process_status_mib("VmRSS")


def _peak_mib(device: torch.device) -> float:
    """Peak of this process. Not ``ru_maxrss``: Linux carries it over from the parent across fork and exec."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return process_status_mib("VmHWM")


def process_status_mib(field: str) -> float:
    """A memory field of this process's ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in MiB."""
    with open("/proc/self/status", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_in_children(script: str, kinds: Sequence[str], argv: Sequence[str]) -> dict[str, dict[str, float]]:
    """Run ``script --measure-memory KIND`` for each kind; the JSON each child prints last."""
    results = {}
    for kind in kinds:
        child = subprocess.run([sys.executable, script, *argv, "--measure-memory", kind],
                               capture_output=True, text=True, check=False, env=CHILD_ENVIRONMENT)
        if child.returncode != 0:
            raise RuntimeError(f"memory measurement of {kind} failed:\n{child.stderr[-4000:]}")
        results[kind] = json.loads(child.stdout.strip().splitlines()[-1])
    return results


def print_comparison(peer: str, ours: str, times: dict[str, float], memory: dict[str, dict[str, float]],
                     params: dict[str, int]) -> dict[str, float]:
    """Print the side-by-side table; return the ratios (ours / peer)."""
    ratios = {
        "step_time_ratio": times[ours] / times[peer],
        "peak_memory_ratio": memory[ours]["peak_mib"] / memory[peer]["peak_mib"],
        "training_memory_ratio": memory[ours]["training_mib"] / memory[peer]["training_mib"],
    }
    print(f"{'':28}{peer:>16}{ours:>16}{'ratio':>8}")
    print(f"{'step time (s)':28}{times[peer]:16.3f}{times[ours]:16.3f}{ratios['step_time_ratio']:8.2f}")
    print(f"{'peak memory (MiB)':28}{memory[peer]['peak_mib']:16.0f}{memory[ours]['peak_mib']:16.0f}"
          f"{ratios['peak_memory_ratio']:8.2f}")
    print(f"{'  of which training (MiB)':28}{memory[peer]['training_mib']:16.0f}{memory[ours]['training_mib']:16.0f}"
          f"{ratios['training_memory_ratio']:8.2f}")
    print(f"{'adapter parameters':28}{params[peer]:16d}{params[ours]:16d}")
    return ratios


Build = Callable[[str, nn.Module, dict[str, torch.Tensor]], Configuration]
COMPILED = " compiled"
FUSED = " fused"


def fusing(build: Build) -> Build:
    """``build``, where a kind ``<kind> fused`` is ``<kind>`` with its expert sites fused."""
    def build_kind(kind: str, base: nn.Module, batch: dict[str, torch.Tensor]) -> Configuration:
        if not kind.endswith(FUSED):
            return build(kind, base, batch)
        configuration = build(kind.removesuffix(FUSED), base, batch)
        fuse_experts(configuration.model)
        return configuration
    return build_kind


def print_fused(peer: str, ours: str, times: dict[str, float], memory: dict[str, dict[str, float]]
                ) -> dict[str, float]:
    """Print the fused side beside the peer and our unfused side; return its ratios."""
    fused = ours + FUSED
    ratios = {"fused_step_time_ratio": times[fused] / times[peer], "fusing_speedup": times[ours] / times[fused],
              "fused_peak_memory_ratio": memory[fused]["peak_mib"] / memory[peer]["peak_mib"]}
    print(f"{'fused experts':28}{fused:>22}{'÷ ' + peer:>16}{'÷ unfused':>12}")
    print(f"{'step time (s)':28}{times[fused]:22.3f}{ratios['fused_step_time_ratio']:16.2f}"
          f"{times[fused] / times[ours]:12.2f}")
    print(f"{'peak memory (MiB)':28}{memory[fused]['peak_mib']:22.0f}{ratios['fused_peak_memory_ratio']:16.2f}"
          f"{memory[fused]['peak_mib'] / memory[ours]['peak_mib']:12.2f}")
    return ratios


def operator_self_ms(step: Step, device: torch.device) -> dict[str, float]:
    """Self time of each operator over one ``step``, in ms: CPU time on the CPU, kernel time on CUDA."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]) as profiler:
        step()
        if on_cuda:
            torch.cuda.synchronize(device)
    field = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    return {event.key: getattr(event, field) / 1e3 for event in profiler.key_averages() if getattr(event, field) > 0}


def print_profiles(peer: str, ours: str, profiles: dict[str, dict[str, float]], top: int = 12
                   ) -> dict[str, dict[str, float]]:
    """Print the ``top`` operators by our side's excess self time over the peer's, then the totals;
    return the profiles."""
    operators = set(profiles[peer]) | set(profiles[ours])
    excess = {op: profiles[ours].get(op, 0.0) - profiles[peer].get(op, 0.0) for op in operators}
    print(f"{'one step, self time (ms)':44}{peer:>14}{ours:>14}{'excess':>10}")
    for op in sorted(operators, key=lambda name: -excess[name])[:top]:
        print(f"{op[:44]:44}{profiles[peer].get(op, 0.0):14.1f}{profiles[ours].get(op, 0.0):14.1f}{excess[op]:10.1f}")
    totals = {name: sum(profile.values()) for name, profile in profiles.items()}
    print(f"{'all operators':44}{totals[peer]:14.1f}{totals[ours]:14.1f}{totals[ours] - totals[peer]:10.1f}")
    return profiles


def compiled_sides(configurations: dict[str, Configuration], build_on_fresh_model: Callable[[str], Configuration],
                   kinds: Sequence[str], device: torch.device) -> dict[str, float]:
    """Add each of ``kinds`` again, built on a freshly loaded base and its model under ``torch.compile``
    (``nn.Module.compile``); returns each one's first step, which compiles forward and backward, in seconds."""
    compile_s = {}
    for kind in kinds:
        configuration = build_on_fresh_model(kind)
        configuration.model.compile()
        start = _clock(device)
        configuration.step()
        compile_s[kind + COMPILED] = _clock(device) - start
        configurations[kind + COMPILED] = configuration
    return compile_s


def print_compiled(peer: str, ours: str, times: dict[str, float], compile_s: dict[str, float]) -> dict[str, float]:
    """Print the compiled sides' step times beside the eager ones; return their ratios."""
    ours_compiled, peer_compiled = ours + COMPILED, peer + COMPILED
    ratios = {"compiled_step_time_ratio": times[ours_compiled] / times[peer_compiled],
              "compiled_vs_eager_peer_ratio": times[ours_compiled] / times[peer],
              "compile_speedup": times[ours] / times[ours_compiled]}
    print(f"{'torch.compile':28}{peer_compiled:>22}{ours_compiled:>22}{'ratio':>8}")
    print(f"{'step time (s)':28}{times[peer_compiled]:22.3f}{times[ours_compiled]:22.3f}"
          f"{ratios['compiled_step_time_ratio']:8.2f}")
    print(f"{'first step, compiling (s)':28}{compile_s[peer_compiled]:22.1f}{compile_s[ours_compiled]:22.1f}")
    print(f"{ours_compiled} ÷ eager {peer}: {ratios['compiled_vs_eager_peer_ratio']:.2f}; "
          f"{ours} eager ÷ compiled: {ratios['compile_speedup']:.2f}")
    return ratios


def compare(description: str, script: str, build: Build, peer: str, ours: str, argv: Sequence[str] | None,
            on_base: Callable[[nn.Module], dict[str, object]] | None = None) -> dict[str, object] | None:
    """Run ``script``'s comparison of ``ours`` against ``peer``: peak memory of each in a child process,
    step times interleaved in this one. ``on_base`` adds figures read off the untouched base model.
    Returns the figures, or ``None`` in a memory-measuring child (which prints its figures for the parent)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser(description).parse_args(argv)
    device = resolve_device(args.device)
    build = fusing(build)

    def build_on_fresh_model(kind: str) -> Configuration:
        loaded = load(args)
        return build(kind, loaded.model, batch_of(args, loaded.model.config.vocab_size, device))

    if args.measure_memory:  # child process
        print(json.dumps(measure_memory(lambda: build_on_fresh_model(args.measure_memory), device)))
        return None
    memory = memory_in_children(script, (peer, ours, *([ours + FUSED] if args.fused else [])), argv)
    loaded = load(args)
    batch = batch_of(args, loaded.model.config.vocab_size, device)
    extra = on_base(loaded.model) if on_base else {}
    configurations = {ours: build(ours, loaded.model, batch)}
    if args.fused:
        configurations[ours + FUSED] = build(ours + FUSED, loaded.model, batch)
    configurations[peer] = build(peer, loaded.model, batch)  # last: PEFT changes the base in place
    compile_s = compiled_sides(configurations, build_on_fresh_model, (ours, peer), device) if args.compile else {}
    times = interleaved_step_times(configurations, args.steps, device)
    params = {name: c.adapter_params for name, c in configurations.items() if name in (peer, ours)}
    ratios = print_comparison(peer, ours, times, memory, params)
    compiled = {**print_compiled(peer, ours, times, compile_s), "compile_s": compile_s} if compile_s else {}
    fused = print_fused(peer, ours, times, memory) if args.fused else {}
    profiles = {"profile_ms": print_profiles(peer, ours, {name: operator_self_ms(configurations[name].step, device)
                                                          for name in (peer, ours)})} if args.profile else {}
    figures = {"model": args.model, "dtype": args.dtype, "device": device.type, "batch": args.batch,
               "context": args.context, "steps": args.steps, "threads": torch.get_num_threads(),
               "step_s": times, "memory_mib": memory, "adapter_params": params,
               **ratios, **compiled, **fused, **profiles, **extra}
    print(json.dumps(figures))
    return figures
