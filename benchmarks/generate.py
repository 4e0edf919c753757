"""``ondevice-moe generate`` against Hugging Face ``generate`` of the exported PEFT adapter, in one run.

Three sides write the same number of new tokens after the same prompt, greedily, their runs
alternating (A B C, C B A, …) so a shared machine slows each alike; the figure is the median
tokens per second of each:

* ``ours`` — the user's mixture as ``ondevice-moe generate`` runs it (experts, routers; a key/value
  cache unless a router reads the whole text, :mod:`ondevice_moe.generate`);
* ``ours-no-cache`` — the same model on the whole text at every step (``generate`` before the cache);
  with ``--fused``, both ``ours`` sides have their expert sites fused (``training.fused_experts``);
* ``peft`` — the user's export (``export --format peft``, the shared experts) loaded with
  ``PeftModel.from_pretrained`` on the same base, through transformers' ``generate``.

Usage:
    python benchmarks/generate.py --run runs/quickstart [--method comigs-1G1S] [--user USER]
        [--prompt TEXT] [--tokens 32] [--repeats 3] [--threads N] [--device cpu|cuda] [--fused]

Prints a table, then (last line) the figures as one JSON object whose last number is the ratio
``ours`` ÷ ``peft`` of tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from ondevice_moe.errors import UserError
from ondevice_moe.export.bundle import export_user
from ondevice_moe.federation.device import job_base_model
from ondevice_moe.generate import Sampling, generate_tokens, prompt_tokens, uses_cache
from ondevice_moe.layout.fused import fuse_experts
from ondevice_moe.models import load_base_model
from ondevice_moe.models.devices import DEVICE_NAMES, model_device, resolve_device
from ondevice_moe.recipe import ModelSection
from ondevice_moe.run_model import open_user_model
from ondevice_moe.runner import finished_jobs

SIDES = ("ours", "ours-no-cache", "peft")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--run", type=Path, default=Path("runs/quickstart"), help="a finished language-modelling run")
    options.add_argument("--method", default="comigs-1G1S")
    options.add_argument("--user", help="default: the run's first user")
    options.add_argument("--prompt", default="def main():")
    options.add_argument("--tokens", type=int, default=32, help="new tokens per generation")
    options.add_argument("--repeats", type=int, default=3, help="timed generations per side, after one warm-up")
    options.add_argument("--device", choices=DEVICE_NAMES, help="default: the run's recipe")
    options.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    options.add_argument("--fused", action="store_true", help="our model's expert sites fused (training.fused_experts)")
    return options.parse_args(argv)


def peft_model(run: Path, method: str, user: str, model: ModelSection, device: str | None,
               folder: Path) -> torch.nn.Module:
    """The user's export in PEFT's format, on a freshly loaded base (the recipe's ``model``), as a PEFT user
    would load it."""
    from peft import PeftModel

    export_user(run, method, user, folder, fmt="peft", device=device)
    base = load_base_model(model.name, model.dtype, model.quantization, device=resolve_device(device or model.device))
    return PeftModel.from_pretrained(base.model, str(folder)).eval()


def timed(generate: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, int]:
    """Seconds of one generation and its new tokens."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    new = generate()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, int(new.numel())


def measure(args: argparse.Namespace) -> dict[str, object]:
    if args.threads:
        torch.set_num_threads(args.threads)
    args.user = args.user or finished_jobs(args.run, args.device)[0].user_names[0]
    ours = open_user_model(args.run, args.method, args.user, args.device)
    if args.fused:
        fuse_experts(ours.model)
    tokenizer = job_base_model(ours.job).tokenizer
    where = model_device(ours.model)
    prompt = prompt_tokens(tokenizer, args.prompt, templated=False).to(where)
    every_token = {"min_new_tokens": args.tokens}  # the same length on each side, whatever the text
    greedy, pad = Sampling(), tokenizer.eos_token_id
    with tempfile.TemporaryDirectory() as folder:
        peer = peft_model(args.run, args.method, args.user, ours.job.recipe.model, args.device,
                          Path(folder) / "export")
    sides: dict[str, Callable[[], torch.Tensor]] = {
        "ours": lambda: generate_tokens(ours.model, prompt, args.tokens, greedy, pad, **every_token),
        "ours-no-cache": lambda: generate_tokens(ours.model, prompt, args.tokens, greedy, pad, use_cache=False,
                                                 **every_token),
        "peft": lambda: _peft_generate(peer, prompt, args.tokens, pad),
    }
    rates: dict[str, list[float]] = {side: [] for side in SIDES}
    for repeat in range(args.repeats + 1):
        for side in SIDES if repeat % 2 == 0 else reversed(SIDES):
            seconds, tokens = timed(sides[side], where)
            if repeat > 0:  # the first is the warm-up
                rates[side].append(tokens / seconds)
    tokens_per_s = {side: statistics.median(values) for side, values in rates.items()}
    return {"method": args.method, "user": args.user, "tokens": args.tokens, "device": str(where), "fused": args.fused,
            "cache": uses_cache(ours.model), "tokens_per_s": tokens_per_s,
            "cache_speedup": tokens_per_s["ours"] / tokens_per_s["ours-no-cache"],
            "ratio_vs_peft": tokens_per_s["ours"] / tokens_per_s["peft"]}


def _peft_generate(model: torch.nn.Module, prompt: torch.Tensor, tokens: int, pad: int | None) -> torch.Tensor:
    with torch.no_grad():
        output = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                                min_new_tokens=tokens, do_sample=False, pad_token_id=pad)
    return output[0, prompt.shape[1]:]


def table(figures: dict[str, object]) -> str:
    rates = figures["tokens_per_s"]
    lines = [f"{'':24}" + "".join(f"{side:>16}" for side in SIDES),
             f"{'tokens / s':24}" + "".join(f"{rates[side]:16.2f}" for side in SIDES),
             f"ours ÷ peft {figures['ratio_vs_peft']:.2f}; cache speed-up {figures['cache_speedup']:.2f}×"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    try:
        figures = measure(args)
    except UserError as error:
        sys.exit(f"generate benchmark: {error}")
    print(table(figures))
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
