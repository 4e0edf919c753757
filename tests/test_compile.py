"""``training.compile``: a device's model under torch.compile trains and scores as the eager one does."""

import pytest
import torch
import yaml
from conftest import VOCAB
from test_strategy import TINY

from ondevice_moe.federation.job import Job
from ondevice_moe.layout import attach_layout
from ondevice_moe.methods import method_for
from ondevice_moe.models.tiny import tiny_llama
from ondevice_moe.recipe import validate_recipe
from ondevice_moe.training import DeviceTrainer, TrainingConfig


def _trainer(compiled: bool) -> DeviceTrainer:
    torch.manual_seed(0)
    base = tiny_llama(VOCAB).requires_grad_(False).eval()
    method = method_for("comigs", 2, variant="1G1S")
    config = TrainingConfig(router_period=2, router_steps=1, batch_size=2, total_iterations=4, lr=1e-2,
                            router_lr=1e-2, compile=compiled)
    return DeviceTrainer(attach_layout(base, method.layouts[0], seed=0), method, config)


def _batch(index: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(index))
    return {"input_ids": tokens, "labels": tokens}


def test_a_compiled_device_model_trains_and_scores_as_the_eager_one():
    eager, compiled = _trainer(False), _trainer(True)
    assert compiled.model._compiled_call_impl is not None and eager.model._compiled_call_impl is None
    for trainer in (eager, compiled):  # expert steps and, every second iteration, a router step
        trainer.train_iterations(3, _batch, lambda index: _batch(100 + index))
    trained = dict(compiled.model.named_parameters())
    assert set(trained) == {name for name, _ in eager.model.named_parameters()}  # compiling renames nothing
    for name, param in eager.model.named_parameters():
        torch.testing.assert_close(trained[name], param, rtol=1e-4, atol=1e-5, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(compiled.model(**_batch(7)).logits, eager.model(**_batch(7)).logits,
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value", [True, False])
def test_the_recipe_key_reaches_the_trainer(value):
    raw = yaml.safe_load(TINY.read_text())
    raw.setdefault("training", {})["compile"] = value
    assert Job(validate_recipe(raw), 0, TINY.parent).training.compile is value
