"""Flow on Hugging Face models (Flow §3 with PEFT experts as the routed layers): a global and a
local LoRA per block and a routed task head, ψ on the mean input embedding (causal on a
language model), the round, what leaves the device, and tiny runs of both task kinds."""

from pathlib import Path

import pytest
import torch
import yaml
from flwr.app import RecordDict

from ondevice_moe import runner
from ondevice_moe.experts.layer_copy import RoutedLayer
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.device_state import private_tensors
from ondevice_moe.federation.evaluation import evaluate_device
from ondevice_moe.federation.job import Job
from ondevice_moe.methods.flow.procedure import flow_round
from ondevice_moe.recipe import load_recipe, validate_recipe
from ondevice_moe.routing.instance_policy import instance_policy

RECIPES = Path(__file__).parent / "recipes"
FLOW = ["methods=[flow]", "flow.lora_rank=4", "flow.policy_hidden=8"]


def _job(recipe: str, overrides: list[str], tmp_path: Path) -> Job:
    return Job(load_recipe(RECIPES / recipe, overrides), 0, tmp_path / "run")


def _perturbed(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Move every trainable tensor off its start (fresh LoRA copies add nothing, so routing would not show)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def _ids(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_a_bert_classifier_routes_a_lora_pair_per_block_and_its_head_and_keeps_the_base_frozen(tmp_path):
    job = _job("tiny-classification.yaml", FLOW, tmp_path)
    model = dev.build_model(job, 0)
    router = instance_policy(model)
    blocks = len(model.bert.encoder.layer)
    heads = [name for name, module in model.named_modules() if isinstance(module, RoutedLayer)]
    assert heads == ["bert.pooler.dense", "classifier"]
    assert len(router.exits) == blocks + len(heads)
    assert len(router.pairs) == 2 * blocks + len(heads)  # query and value per block, then the head's layers
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    assert any(".query.adapters.shared_0." in n for n in trainable)
    assert any(".value.adapters.private_0." in n for n in trainable)
    assert not any(n.endswith("query.base.weight") or "embeddings" in n for n in trainable), "the base stays frozen"


@pytest.mark.parametrize(("recipe", "overrides"), [
    ("tiny-classification.yaml", FLOW),
    ("tiny.yaml", [*FLOW, "model.name=tiny-llama"]),
], ids=["bert-classifier", "llama-lm"])
def test_each_instance_runs_through_the_copies_its_one_hot_route_picks(tmp_path, recipe, overrides):
    """Hard routing (eq. 3 at q ∈ {0, 1}): an instance routed to the global copies gives what the
    global path gives it, an instance routed to the local copies what the local path gives."""
    model = _perturbed(dev.build_model(_job(recipe, overrides, tmp_path), 0)).eval()
    router = instance_policy(model)
    ids = _ids(2, 12, seed=2)
    outputs = {}
    with torch.no_grad():
        for path in ("global", "local"):
            router.path = path
            outputs[path] = model(input_ids=ids).logits
        router.path = "policy"
        route = router.route

        def split_route(features):  # instance 0 to the global copies, instance 1 to the local ones
            q = route(features)
            fixed = torch.zeros_like(q[0])
            fixed[0, ..., 0] = 1.0
            fixed[1, ..., 1] = 1.0
            router.last_q = [fixed] * len(q)
            return router.last_q

        router.route = split_route
        mixed = model(input_ids=ids).logits
    assert not torch.allclose(outputs["global"], outputs["local"], atol=1e-4), "the copies differ"
    torch.testing.assert_close(mixed[0], outputs["global"][0])
    torch.testing.assert_close(mixed[1], outputs["local"][1])


def test_a_language_models_route_reads_only_the_context_of_each_position(tmp_path):
    """ψ reads the running mean of the embeddings: changing later tokens changes no earlier
    route and no earlier logit, in training (soft) and at inference (hard)."""
    model = _perturbed(dev.build_model(_job("tiny.yaml", [*FLOW, "model.name=tiny-llama"], tmp_path), 0))
    router = instance_policy(model)
    first, cut = _ids(2, 16, seed=3), 9
    second = first.clone()
    second[:, cut:] = _ids(2, 16 - cut, seed=4)
    for training in (True, False):
        model.train(training)
        with torch.no_grad():
            logits_first = model(input_ids=first).logits
            q_first = [q.clone() for q in router.last_q]
            logits_second = model(input_ids=second).logits
        assert q_first[0].shape == (2, 16, 2)
        for a, b in zip(q_first, router.last_q, strict=True):
            torch.testing.assert_close(a[:, :cut], b[:, :cut])
            assert not torch.allclose(a[:, cut:], b[:, cut:])
        torch.testing.assert_close(logits_first[:, :cut], logits_second[:, :cut])


def test_a_round_trains_both_copies_and_only_the_global_parts_and_psi_leave_the_device(tmp_path):
    job = _job("tiny-classification.yaml", FLOW, tmp_path)
    state = RecordDict()
    trainer = dev.restore_trainer(job, 0, None, state)
    frozen = {n: t.clone() for n, t in trainer.model.state_dict().items() if n.endswith("query.base.weight")}
    examples = dev.federated_task(job).train[0]
    metrics, weight = flow_round(trainer, examples, job.recipe.task.batch_size, seed=0)
    assert weight in (len(examples) // 2, len(examples) - len(examples) // 2)  # |ζ_g|
    assert {"train_loss_local", "train_loss", "router_loss", "q0_layer_0"} <= set(metrics)
    for global_copy, local_copy in instance_policy(trainer.model).pairs:
        assert not torch.equal(global_copy.state_dict()[next(iter(global_copy.state_dict()))],
                               local_copy.state_dict()[next(iter(local_copy.state_dict()))])
    state_now = trainer.model.state_dict()
    assert all(torch.equal(state_now[n], t) for n, t in frozen.items()), "the frozen base did not move"
    tensors, _ = dev.upload(job, trainer)
    assert not any("private" in name for name in tensors)
    assert any(".adapters.shared_0." in name for name in tensors) and any(n.startswith("router.") for n in tensors)
    assert any(name.startswith("classifier.base.") for name in tensors), "the global head is averaged"
    dev.save_private_state(job, 0, trainer, state, 1)
    assert private_tensors(state) and all(".private_0." in name for name in private_tensors(state))


def test_flow_runs_on_a_language_model_and_reports_both_models_perplexities(tmp_path):
    raw = yaml.safe_load((RECIPES / "tiny.yaml").read_text())
    raw.update(methods=["flow"], flow={"lora_rank": 4, "policy_hidden": 8})
    raw["federation"]["rounds"] = 1
    result = runner.run_recipe(validate_recipe(raw), tmp_path / "run")
    flow = result.summary["methods"]["flow"]
    users = flow["per_user"]
    assert all({"in", "in_global", "out", "out_global"} <= set(values) for values in users.values())
    assert flow["benefiting_pct"] == pytest.approx(
        100 * sum(v["in"] < v["in_global"] for v in users.values()) / len(users))
    assert "| method | ppl_g in | ppl_p in |" in (tmp_path / "run" / "report.md").read_text()


def test_a_language_model_adapted_before_its_test_keeps_its_global_perplexity(tmp_path):
    """``evaluation: adapted`` on a language model: the device tests a copy whose local LoRA copies
    and ψ adapted on its training blocks; the global path's perplexity is the model's own."""
    job = _job("tiny.yaml", [*FLOW, "flow.evaluation=adapted"], tmp_path)
    trainer = dev.restore_trainer(job, 0, None, RecordDict())
    flow_round(trainer, dev.JobDevice(job, 0).training_examples(), dev.JobDevice(job, 0).batch_size, seed=0)
    as_trained = _job("tiny.yaml", FLOW, tmp_path)
    adapted = evaluate_device(job, 0, trainer.model)
    plain = evaluate_device(as_trained, 0, trainer.model)
    assert adapted["user_0/test_ppl_in_global"] == pytest.approx(plain["user_0/test_ppl_in_global"])
    assert adapted["user_0/test_ppl_in"] != pytest.approx(plain["user_0/test_ppl_in"], rel=1e-6)
