"""CoMiGS-1G1S client cost against its peers, side by side in one run.

* Step time and peak memory of one CoMiGS-1G1S expert step against a plain
  HF PEFT LoRA model with the same number of *active* adapter parameters
  (rank 8 on attention, rank 16 on the MLP = two rank-8 experts), on the same
  base model and the same batch. Each configuration runs in a fresh
  subprocess so that its peak resident memory is its own.
* Bytes uploaded per round by a CoMiGS-1G1S device against a FedAvg device
  with two LoRA modules, counted from the tensors the Flower client sends.

Usage:
    python benchmarks/comigs_client.py [--model smollm2-135m] [--dtype float32] [--batch 4] [--steps 5]

Prints a table, then (last line) the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _rss_mib() -> float:
    with open("/proc/self/status", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(kind: str, model_name: str, dtype: str, batch: int, steps: int, context: int) -> dict[str, float]:
    """Run in a subprocess: build one configuration and time its training steps."""
    import torch

    from ondevice_moe.inject import ExpertLayout, attach_experts
    from ondevice_moe.methods import build_method
    from ondevice_moe.models import load_base_model
    from ondevice_moe.training import DeviceTrainer, TrainingConfig

    torch.manual_seed(0)
    loaded = load_base_model(model_name, dtype)
    vocab = loaded.model.config.vocab_size
    tokens = torch.randint(0, vocab, (batch, context), generator=torch.Generator().manual_seed(0))
    if kind == "peft-lora":
        from peft import LoraConfig, get_peft_model

        names = _linear_names(loaded.model)
        config = LoraConfig(r=8, lora_alpha=16, use_rslora=True, target_modules=names["attention"] + names["mlp"],
                            rank_pattern={name: 16 for name in names["mlp"]}, lora_dropout=0.0)
        model = get_peft_model(loaded.model, config)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=2e-3)

        def step() -> None:
            model.train()
            loss = model(input_ids=tokens, labels=tokens).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        active = sum(p.numel() for p in params)
    else:
        method = build_method("comigs", ExpertLayout(), num_users=4, variant="1G1S")
        trainer = DeviceTrainer(attach_experts(loaded.model, method.layouts[0], seed=0), method,
                                TrainingConfig(total_iterations=steps + 2))

        def step() -> None:
            trainer.expert_step(tokens)

        # Both experts are active for every token (top-2 of 2); the router is not an adapter.
        active = sum(p.numel() for p in trainer.expert_parameters())
    loaded_rss = _rss_mib()
    step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"step_s": statistics.median(times), "peak_rss_mib": peak, "train_overhead_mib": peak - loaded_rss,
            "active_adapter_params": active}


def _linear_names(model) -> dict[str, list[str]]:
    from ondevice_moe.inject import architecture_of

    arch = architecture_of(model)
    return {"attention": list(arch.attention_linears), "mlp": list(arch.mlp_linears)}


def upload_bytes(model_name: str) -> dict[str, int]:
    from ondevice_moe.federation.device import shared_state
    from ondevice_moe.inject import ExpertLayout, attach_experts
    from ondevice_moe.methods import build_method
    from ondevice_moe.models import load_base_model
    from ondevice_moe.training import DeviceTrainer, TrainingConfig

    base = load_base_model(model_name).model
    sizes = {}
    for name, options in (("comigs-1G1S", {"variant": "1G1S"}), ("fedavg", {})):
        method = build_method("comigs" if name.startswith("comigs") else name, ExpertLayout(), 4, **options)
        trainer = DeviceTrainer(attach_experts(base, method.layouts[0], seed=0), method, TrainingConfig())
        sizes[name] = sum(t.numel() * t.element_size() for t in shared_state(trainer).values())
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--measure", choices=["comigs-1G1S", "peft-lora"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.measure:  # child process
        print(json.dumps(measure(args.measure, args.model, args.dtype, args.batch, args.steps, args.context)))
        return

    results = {}
    for kind in ("peft-lora", "comigs-1G1S"):
        child = subprocess.run(
            [sys.executable, __file__, "--measure", kind, "--model", args.model, "--dtype", args.dtype,
             "--batch", str(args.batch), "--steps", str(args.steps), "--context", str(args.context)],
            capture_output=True, text=True, check=True,
        )
        results[kind] = json.loads(child.stdout.strip().splitlines()[-1])
    uploads = upload_bytes(args.model)
    peer, ours = results["peft-lora"], results["comigs-1G1S"]
    figures = {
        "model": args.model, "dtype": args.dtype, "batch": args.batch, "context": args.context,
        "peft_lora_step_s": peer["step_s"], "comigs_step_s": ours["step_s"],
        "step_time_ratio": ours["step_s"] / peer["step_s"],
        "peft_lora_peak_rss_mib": peer["peak_rss_mib"], "comigs_peak_rss_mib": ours["peak_rss_mib"],
        "peak_memory_ratio": ours["peak_rss_mib"] / peer["peak_rss_mib"],
        "training_overhead_ratio": ours["train_overhead_mib"] / peer["train_overhead_mib"],
        "active_adapter_params": {"peft-lora": peer["active_adapter_params"],
                                  "comigs-1G1S": ours["active_adapter_params"]},
        "upload_bytes_per_round": uploads,
        "upload_ratio_vs_fedavg": uploads["comigs-1G1S"] / uploads["fedavg"],
    }
    print(f"{'':28}{'PEFT LoRA':>14}{'CoMiGS-1G1S':>14}{'ratio':>8}")
    print(f"{'step time (s)':28}{peer['step_s']:14.3f}{ours['step_s']:14.3f}{figures['step_time_ratio']:8.2f}")
    print(f"{'peak RSS (MiB)':28}{peer['peak_rss_mib']:14.0f}{ours['peak_rss_mib']:14.0f}"
          f"{figures['peak_memory_ratio']:8.2f}")
    print(f"{'  of which training (MiB)':28}{peer['train_overhead_mib']:14.0f}{ours['train_overhead_mib']:14.0f}"
          f"{figures['training_overhead_ratio']:8.2f}")
    print(f"{'active adapter params':28}{peer['active_adapter_params']:14d}{ours['active_adapter_params']:14d}")
    print(f"{'':28}{'FedAvg (2 LoRA)':>14}{'CoMiGS-1G1S':>14}")
    print(f"{'upload bytes / round':28}{uploads['fedavg']:14d}{uploads['comigs-1G1S']:14d}"
          f"{figures['upload_ratio_vs_fedavg']:8.2f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
