"""Every method that runs on a language model trains a round on an NF4 or int8 base.

The small-model methods (FedSoft, IFCA, Flow, FedAvgFT, Ensemble) train every weight of
a small torch model and have no quantized form; full fine-tuning (``fed-ft``,
``centralized`` on a full model) is refused on a quantized base at recipe validation
(``tests/test_methods.py``). Each case runs the method's real local procedure on one
device, its base loaded through transformers and bitsandbytes, and checks that the
experts learned while every quantized weight stayed as it was.
"""

from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict

from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.recipe import validate_recipe

LANGUAGE_MODELLING = [
    "local", "fedavg", "local-moe", "fedavg-moe", "pfedmoe", "fdlora", "ffa-lora", "fedsa-lora", "pcl",
    {"name": "hetlora", "ranks": [4, 2]}, {"name": "flexlora", "ranks": [4, 2]},
    "fed-lora", "fed-adapter", "fed-prefix", "fed-unipelt", "hermes", {"name": "comigs", "variant": "1G1S"},
    {"name": "floral", "clusters": 2, "train_base": False}, {"name": "local-adaptor", "train_base": False},
    {"name": "mixture", "experts": [{"kind": "adapter", "role": "shared"}, {"kind": "prefix", "role": "private"}],
     "router": "token-topk", "mixing": "block"},
]
CLASSIFICATION = ["hermes", "fed-lora", "fed-adapter", "fed-prefix", "fed-unipelt",
                  {"name": "local-adaptor", "train_base": False},
                  {"name": "floral", "clusters": 2, "train_base": False}]


def _recipe(folder: Path, quantization: str, method, classification: bool) -> dict:
    users = [{"name": "code", "source": "python-code"}, {"name": "news", "source": "bbc-news"}]
    raw = {
        "name": "quantized", "seed": 0,
        "model": {"name": str(folder), "quantization": quantization},
        "federation": {"rounds": 1, "local_iterations": 2, "cpus_per_client": 1},
        "training": {"router_period": 1, "router_steps": 1},
        "methods": [method],
    }
    if classification:
        raw["task"] = {"name": "rotten-tomatoes", "clients": 2, "max_train_examples": 32, "max_test_examples": 8,
                       "max_length": 16, "batch_size": 4, "eval_batch_size": 8}
    else:
        raw["data"] = {"context_length": 16, "batch_size": 2, "eval_batch_size": 4, "train_tokens": 400,
                       "valid_tokens": 200, "test_tokens": 200, "users": users}
    return raw


def _name(method) -> str:
    return method if isinstance(method, str) else method["name"]


def _trains_on_quantized_base(folder: Path, quantization: str, method, classification: bool) -> None:
    job = Job(validate_recipe(_recipe(folder, quantization, method, classification)), 0, Path("."))
    trainer = dev.restore_trainer(job, 0, None, RecordDict())
    model = trainer.model
    quantized = {name: p.detach().clone() for name, p in model.named_parameters()
                 if p.dtype in (torch.uint8, torch.int8)}
    assert quantized, "bitsandbytes should have quantized the base's linear layers"
    experts = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    assert experts and all(p.is_floating_point() for p in experts.values())
    metrics, examples = dev.run_local_procedure(job, 0, trainer, seed=0)
    assert examples > 0 and all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))
    after = dict(model.named_parameters())
    moved = [name for name, before in experts.items() if not torch.equal(before, after[name].detach())]
    assert moved, f"{_name(method)}: no expert weight changed"
    assert all(torch.equal(before, after[name].detach()) for name, before in quantized.items())


@pytest.mark.parametrize("method", LANGUAGE_MODELLING, ids=_name)
def test_language_model_methods_train_on_an_nf4_base(saved_tiny_models, method):
    _trains_on_quantized_base(saved_tiny_models["tiny-llama"], "nf4", method, classification=False)


@pytest.mark.parametrize("method", CLASSIFICATION, ids=_name)
def test_classifier_methods_train_on_an_int8_base(saved_tiny_models, method):
    _trains_on_quantized_base(saved_tiny_models["tiny-bert"], "int8", method, classification=True)


def test_floral_training_its_base_is_refused_on_a_quantized_base_with_the_way_out(saved_tiny_models):
    raw = _recipe(saved_tiny_models["tiny-llama"], "nf4", {"name": "floral", "clusters": 2}, classification=False)
    with pytest.raises(UserError, match=r"train every base weight.*`train_base: false`"):
        validate_recipe(raw)


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_a_device_training_leaves_the_shared_quantized_base_as_the_next_device_finds_it(saved_tiny_models,
                                                                                        quantization):
    # Devices of one worker process share one base. bitsandbytes' int8 layers move their codes from the
    # weight into a per-layer state on their first forward; a device with its own state took them away
    # from every later device, whose loss then rose by orders of magnitude (the demo reached ppl 8e6).
    raw = _recipe(saved_tiny_models["tiny-llama"], quantization, {"name": "comigs", "variant": "1G1S"}, False)
    job = Job(validate_recipe(raw), 0, Path("."))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

    def fresh_loss(device: int) -> float:
        model = dev.build_model(job, device).eval()
        with torch.no_grad():
            return model(input_ids=tokens, labels=tokens).loss.item()

    before = fresh_loss(1)
    trainer = dev.restore_trainer(job, 0, None, RecordDict())
    dev.run_local_procedure(job, 0, trainer, seed=0)
    assert fresh_loss(1) == before
