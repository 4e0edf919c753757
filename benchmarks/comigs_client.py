"""CoMiGS-1G1S client cost against its peers, side by side in one run.

* Step time and peak memory of one CoMiGS-1G1S expert step against a plain
  HF PEFT LoRA model with the same number of *active* adapter parameters
  (rank 8 on attention, rank 16 on the MLP = two rank-8 experts), on the same
  base model and the same batch (timing and memory: see ``harness.py``).
* Bytes uploaded per round by a CoMiGS-1G1S device against a FedAvg device
  with two LoRA modules, counted from the tensors the Flower client sends.

Usage:
    python benchmarks/comigs_client.py [--model smollm2-135m] [--dtype float32|bfloat16]
        [--device auto|cpu|cuda] [--batch 4] [--context 128] [--steps 5] [--threads N] [--compile] [--fused]
        [--profile]

Prints a table, then (last line) the figures as one JSON object.
"""

from __future__ import annotations

from collections.abc import Sequence

import harness
from harness import Configuration
from torch import nn

from ondevice_moe.federation.device import shared_state
from ondevice_moe.layout import attach_layout, sites_of
from ondevice_moe.methods.registry import method_for
from ondevice_moe.training import DeviceTrainer, TrainingConfig

PEER, OURS = "peft-lora", "comigs-1G1S"


def comigs_trainer(base, method_name: str = "comigs", **options) -> DeviceTrainer:
    method = method_for(method_name, 4, **options)
    return DeviceTrainer(attach_layout(base, method.layouts[0], seed=0), method, TrainingConfig())


def build(kind: str, base, batch) -> Configuration:
    """CoMiGS-1G1S on a copy of ``base`` (sharing its weights), or PEFT LoRA on ``base`` itself."""
    if kind == OURS:
        return harness.trainer_configuration(comigs_trainer(base, variant="1G1S"), batch)
    sites, _ = sites_of(base)
    mlp = [f"{sites.mlp}.{name}" for name in sites.mlp_linears]
    return harness.peft_lora_configuration(base, [*sites.attention_linears, *mlp], batch,
                                           rank_pattern={name: 16 for name in mlp})


def upload_bytes(base) -> dict[str, int]:
    """Bytes a device sends per round: CoMiGS-1G1S (generalists + attention LoRA) and FedAvg (everything)."""
    sizes = {}
    sides = ((OURS, comigs_trainer(base, variant="1G1S")), ("fedavg", comigs_trainer(base, "fedavg-two-lora")))
    for name, trainer in sides:
        sizes[name] = sum(t.numel() * t.element_size() for t in shared_state(trainer).values())
    return sizes


def upload_figures(base: nn.Module) -> dict[str, object]:
    """Upload per device per round of CoMiGS-1G1S against FedAvg with two LoRA modules."""
    uploads = upload_bytes(base)
    print(f"{'':28}{'FedAvg (2 LoRA)':>16}{OURS:>16}")
    print(f"{'upload bytes / round':28}{uploads['fedavg']:16d}{uploads[OURS]:16d}"
          f"{uploads[OURS] / uploads['fedavg']:8.2f}")
    return {"upload_bytes_per_round": uploads, "upload_ratio_vs_fedavg": uploads[OURS] / uploads["fedavg"]}


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    return harness.compare(__doc__, __file__, build, PEER, OURS, argv, upload_figures) or {}


if __name__ == "__main__":
    main()
