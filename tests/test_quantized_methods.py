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
from method_cases import CLASSIFICATION, LANGUAGE_MODELLING, case_name, method_recipe

from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.recipe import validate_recipe


def _trains_on_quantized_base(folder: Path, quantization: str, method, classification: bool) -> None:
    job = Job(validate_recipe(method_recipe(folder, quantization, method, classification)), 0, Path("."))
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
    assert moved, f"{case_name(method)}: no expert weight changed"
    assert all(torch.equal(before, after[name].detach()) for name, before in quantized.items())


@pytest.mark.parametrize("method", LANGUAGE_MODELLING, ids=case_name)
def test_language_model_methods_train_on_an_nf4_base(saved_tiny_models, method):
    _trains_on_quantized_base(saved_tiny_models["tiny-llama"], "nf4", method, classification=False)


@pytest.mark.parametrize("method", CLASSIFICATION, ids=case_name)
def test_classifier_methods_train_on_an_int8_base(saved_tiny_models, method):
    _trains_on_quantized_base(saved_tiny_models["tiny-bert"], "int8", method, classification=True)


def test_floral_training_its_base_is_refused_on_a_quantized_base_with_the_way_out(saved_tiny_models):
    raw = method_recipe(saved_tiny_models["tiny-llama"], "nf4", {"name": "floral", "clusters": 2}, classification=False)
    with pytest.raises(UserError, match=r"train every base weight.*`train_base: false`"):
        validate_recipe(raw)


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_a_device_training_leaves_the_shared_quantized_base_as_the_next_device_finds_it(saved_tiny_models,
                                                                                        quantization):
    # Devices of one worker process share one base. bitsandbytes' int8 layers move their codes from the
    # weight into a per-layer state on their first forward; a device with its own state took them away
    # from every later device, whose loss then rose by orders of magnitude (the demo reached ppl 8e6).
    raw = method_recipe(saved_tiny_models["tiny-llama"], quantization, {"name": "comigs", "variant": "1G1S"}, False)
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
