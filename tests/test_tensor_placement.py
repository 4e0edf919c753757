"""A device's training step makes its tensors where the model is, never on torch's default device.

On CUDA a tensor made without ``device=`` sits on the CPU beside a model on the GPU. On an H200
(docs/quantization.md, "On CUDA") that stopped Hermes' step (its gradient view, Hermes eq. 5, added
CPU norms to a CUDA buffer) and, in every routed method, the sum of the routers' scores over a
round. A CPU machine sees the same mistake when ``meta`` is the default device: a tensor made
without a device then lands on ``meta``, and mixing it with the model's CPU tensors fails just as
mixing CPU with CUDA did.
"""

from __future__ import annotations

import math

import pytest
import torch

from ondevice_moe.layout import attach_layout
from ondevice_moe.methods.registry import method_for
from ondevice_moe.models import load_base_model
from ondevice_moe.training import DeviceTrainer, TrainingConfig

METHODS = [
    ("local", {}), ("fedavg", {}), ("local-moe", {}), ("fedavg-moe", {}), ("pfedmoe", {}), ("fdlora", {}),
    ("ffa-lora", {}), ("fedsa-lora", {}), ("pcl", {}), ("hetlora", {"ranks": [4, 2]}),
    ("flexlora", {"ranks": [4, 2]}), ("fed-lora", {}), ("fed-adapter", {}), ("fed-prefix", {}),
    ("fed-unipelt", {}), ("hermes", {}), ("comigs", {"variant": "1G1S"}), ("comigs", {}),
    ("floral", {"clusters": 2}), ("local-adaptor", {}), ("flow", {}),
]


@pytest.fixture(scope="module")
def base():
    return load_base_model("tiny-llama").model


def _batch(vocab_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize(("name", "options"), METHODS, ids=lambda value: str(value) if value else "")
def test_a_round_of_steps_makes_no_tensor_on_the_default_device(base, name: str, options: dict) -> None:
    method = method_for(name, 2, **options)
    trainer = DeviceTrainer(attach_layout(base, method.layouts[0], seed=0), method,
                            TrainingConfig(router_period=1, router_steps=1))
    before = {key: value.detach().clone() for key, value in trainer.model.named_parameters() if value.requires_grad}
    batch = _batch(base.config.vocab_size)
    with torch.device("meta"):
        metrics = trainer.train_iterations(2, lambda _: dict(batch), lambda _: dict(batch))
    assert math.isfinite(metrics["train_loss"])
    moved = [key for key, value in trainer.model.named_parameters() if key in before and value.device.type == "cpu"
             and not torch.equal(value, before[key])]
    assert moved, f"{name}: no trainable tensor changed"
    assert all(value.device.type == "cpu" for value in trainer.model.state_dict().values())

