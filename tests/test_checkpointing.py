"""Activation checkpointing (``model.activation_checkpointing``): the same step, replayed blocks,
and routers that count each token once."""

from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict

from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.models.checkpointing import enable_activation_checkpointing, recording, replaying
from ondevice_moe.models.small import small_model
from ondevice_moe.recipe import load_recipe
from ondevice_moe.routing.hermes import HermesRouter

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
METHODS = {
    "comigs-1G1S": ("tiny-gpt2", "{name: comigs, variant: 1G1S}"),
    "hermes": ("tiny-llama", "hermes"),
    "fed-prefix": ("tiny-llama", "fed-prefix"),
    "floral": ("tiny-gpt2", "{name: floral, clusters: 2, train_base: false}"),
    "hermes-router-in-mlp": ("tiny-llama", "{name: mixture, experts: [{kind: lora, role: shared}, "
                                           "{kind: lora, role: private}], router: hermes, mixing: mlp}"),
}


def _trainer(method: str, checkpointing: bool):
    model, entry = METHODS[method]
    recipe = load_recipe(TINY, [f"model.name={model}", f"methods=[{entry}]",
                                f"model.activation_checkpointing={str(checkpointing).lower()}"])
    return dev.restore_trainer(Job(recipe, 0, Path(".")), 0, None, RecordDict())


def _batch(vocab_size: int) -> dict[str, torch.Tensor]:
    """Two sequences of 24 tokens, the second right-padded after 16."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (2, 24), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 16:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100)}


def _seeded_step(trainer, batch: dict[str, torch.Tensor]) -> float:
    """One expert step from the same random state (GPT-2's dropout draws from it)."""
    torch.manual_seed(0)
    return trainer.expert_step(batch)


def _block_forwards(model: torch.nn.Module) -> list[int]:
    """A counter of calls of the first decoder block's MLP, which sits inside the checkpoint (a
    pre-hook: the replay stops once it has rebuilt every saved tensor, before the MLP returns)."""
    calls = [0]
    mlp = next(module for name, module in model.named_modules() if name.endswith(("0.mlp", "0.intermediate")))
    mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("method", list(METHODS))
def test_a_checkpointed_step_replays_each_block_and_trains_exactly_as_the_plain_one(method):
    plain, checkpointed = _trainer(method, False), _trainer(method, True)
    batch = _batch(plain.model.config.vocab_size)
    counters = [_block_forwards(t.model) for t in (plain, checkpointed)]
    losses = [_seeded_step(t, batch) for t in (plain, checkpointed)]
    assert counters[0][0] == 1 and counters[1][0] == 2, "the checkpointed block runs again in the backward pass"
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    after = dict(checkpointed.model.named_parameters())
    trained = [(name, p) for name, p in plain.model.named_parameters() if p.requires_grad]
    assert trained
    for name, param in trained:
        torch.testing.assert_close(after[name], param, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("method", ["hermes", "hermes-router-in-mlp"])
def test_hermes_routers_count_each_real_token_once_under_checkpointing(method):
    """On the block input the router runs outside the checkpoint; in the MLP it is replayed."""
    plain, checkpointed = _trainer(method, False), _trainer(method, True)
    batch = _batch(plain.model.config.vocab_size)
    for trainer in (plain, checkpointed):
        _seeded_step(trainer, batch)
    real_tokens = int(batch["attention_mask"].sum())
    routers = [[m for m in t.model.modules() if isinstance(m, HermesRouter)] for t in (checkpointed, plain)]
    for ours, reference in zip(*routers, strict=True):
        assert torch.equal(ours.usage, reference.usage)
        assert int(ours.usage.sum()) == real_tokens * ours.top_k


def test_recording_pauses_only_inside_a_replay():
    assert recording()
    with replaying():
        assert not recording()
    assert recording()


def test_models_without_blocks_and_small_model_recipes_are_refused():
    with pytest.raises(UserError, match="no blocks to checkpoint"):
        enable_activation_checkpointing(small_model("mlp", (8,), 2, False, 0))
    with pytest.raises(UserError, match="no transformer blocks to checkpoint"):
        load_recipe(Path(__file__).parent / "recipes" / "tiny-digits.yaml", ["model.activation_checkpointing=true"])
