"""Flow (Panchal et al.): routed layer copies (eq. 3), the policy and its regulariser (eq. 2, 4),
the round (Alg. 1), what leaves the device, and a digits run (eq. 6-7, Table 3)."""

from pathlib import Path

import pytest
import torch
import yaml
from flwr.app import RecordDict
from torch import nn

from ondevice_moe import runner
from ondevice_moe.errors import UserError
from ondevice_moe.experts.layer_copy import RoutedLayer, routed_layers
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.device_state import private_tensors
from ondevice_moe.federation.evaluation import evaluate_device
from ondevice_moe.federation.job import Job
from ondevice_moe.layout import ExpertSpec, Layout, RouterSpec, attach_layout
from ondevice_moe.methods.flow.procedure import adapted_for_test, flow_round, round_key, split_halves, training_rows
from ondevice_moe.models.small import small_model
from ondevice_moe.recipe import load_recipe, validate_recipe
from ondevice_moe.routing.instance_policy import InstancePolicyRouter, instance_policy, policy_regulariser
from ondevice_moe.training import trainable_state

TINY_FLOW = Path(__file__).parent / "recipes" / "tiny-flow.yaml"
FLOW_LAYOUT = Layout((ExpertSpec("layer-copy", "private"),), RouterSpec("instance-policy", policy_hidden=8),
                     "layer-copies")


def _layer(base: nn.Module, q: torch.Tensor) -> RoutedLayer:
    layer = RoutedLayer(base, lambda: q)
    with torch.no_grad():
        for param in layer.local.parameters():
            param.add_(torch.randn_like(param))
    return layer


@pytest.mark.parametrize("base, shape", [(nn.Linear(5, 3), (4, 5)), (nn.Conv2d(2, 3, 3, padding=1), (4, 2, 6, 6))])
def test_hard_routing_runs_each_instance_through_its_copy_as_the_soft_mixture_does_at_q_0_or_1(base, shape):
    torch.manual_seed(0)
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    layer, x = _layer(base, q), torch.randn(shape)
    routed = layer(x)  # one-hot weights: the hard path, each instance through one copy only
    view = (-1,) + (1,) * (x.dim() - 1)
    soft = q[:, 0].view(view) * layer.base(x) + q[:, 1].view(view) * layer.local(x)  # eq. 3
    torch.testing.assert_close(routed, soft)
    assert not torch.allclose(layer.base(x), layer.local(x)), "the copies differ, so the test can fail"


def test_soft_weights_mix_both_copies_by_eq_3():
    torch.manual_seed(0)
    q = torch.tensor([[0.3, 0.7], [0.9, 0.1]])
    layer, x = _layer(nn.Linear(5, 3), q), torch.randn(2, 5)
    torch.testing.assert_close(layer(x), q[:, :1] * layer.base(x) + q[:, 1:] * layer.local(x))


def test_the_policy_is_soft_in_training_and_rounded_at_inference():
    router = InstancePolicyRouter(6, exits=2, hidden=4, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 6)
    router.route(x)
    router.train()
    soft = router.weights(1)
    assert ((soft > 0) & (soft < 1)).all()
    router.eval()
    torch.testing.assert_close(router.weights(1), nn.functional.one_hot(soft.argmax(-1), 2).float())
    router.path = "global"
    assert (router.weights(0)[:, 0] == 1).all()


def test_the_regulariser_pushes_every_exit_toward_the_global_path():
    """Eq. 4: a gradient step on −(1/L) Σ_j log q_0^(j) raises q_0 at every exit, for every instance."""
    torch.manual_seed(0)
    router = InstancePolicyRouter(6, exits=3, hidden=4, generator=torch.Generator().manual_seed(1))
    x = torch.randn(8, 6)
    before = [q[:, 0].detach() for q in router.route(x)]
    policy_regulariser(router).backward()
    for exit_ in router.exits:
        assert exit_.bias.grad[0] < 0 < exit_.bias.grad[1]
    with torch.no_grad():
        for param in router.parameters():
            param -= 0.1 * param.grad
    after = [q[:, 0] for q in router.route(x)]
    for old, new in zip(before, after, strict=True):
        assert (new > old).all()


def test_the_flow_layout_routes_every_layer_of_a_small_model_and_the_model_forward_uses_psi():
    model = attach_layout(small_model("cnn", (1, 8, 8), 10, channels=(2, 4), hidden=(8,)), FLOW_LAYOUT, seed=0)
    assert len(routed_layers(model)) == 4 and len(instance_policy(model).exits) == 4
    names = [name for name, _ in model.named_parameters()]
    assert any(".private_0." in name for name in names) and any(name.startswith("router.") for name in names)
    out = model(torch.randn(3, 1, 8, 8)).logits
    assert out.shape == (3, 10) and [q.shape for q in instance_policy(model).last_q] == [(3, 2)] * 4


def test_the_halves_are_disjoint_cover_the_data_and_follow_the_seed():
    local, global_ = split_halves(41, 0.5, seed=3)
    assert set(local.tolist()).isdisjoint(global_.tolist())
    assert sorted(local.tolist() + global_.tolist()) == list(range(41))
    assert abs(len(local) - len(global_)) == 1
    again, _ = split_halves(41, 0.5, seed=3)
    other, _ = split_halves(41, 0.5, seed=4)
    assert torch.equal(local, again) and not torch.equal(local, other)


def test_a_round_resets_and_trains_the_local_copies_which_never_leave_the_device():
    job = Job(load_recipe(TINY_FLOW), 0, Path("."))
    state = RecordDict()
    trainer = dev.restore_trainer(job, 0, None, state)
    global_before = {n: t.clone() for n, t in trainer.model.state_dict().items() if n.startswith("net.")
                     and ".base." in n}
    metrics, weight = flow_round(trainer, dev.federated_task(job).train[0], job.recipe.task.batch_size, seed=0)
    examples = len(dev.federated_task(job).train[0])
    assert weight == examples - examples // 2 or weight == examples // 2  # |ζ_g| (Alg. 1 line 12)
    assert {"train_loss_local", "train_loss", "router_loss", "q0_layer_0"} <= set(metrics)
    state_now = trainer.model.state_dict()
    for layer in routed_layers(trainer.model):
        assert not torch.equal(layer.base.weight, layer.local.weight), "the local copy trained on ζ_ℓ"
    assert any(not torch.equal(state_now[n], t) for n, t in global_before.items()), "the global copy trained"
    tensors, _ = dev.upload(job, trainer)
    assert tensors and not any("private" in name for name in tensors)
    assert any(name.startswith("router.") for name in tensors), "ψ is shared (Alg. 1 line 12)"
    assert not any("private" in name for name in dev.upload_reference(job, 0))
    dev.save_private_state(job, 0, trainer, state, 1)
    assert all(".private_0." in name for name in private_tensors(state))


def test_wrong_layouts_and_models_say_how_to_fix_them():
    with pytest.raises(UserError, match="instance-policy"):
        Layout((ExpertSpec("layer-copy", "private"),), RouterSpec("token-topk"), "layer-copies")
    with pytest.raises(UserError, match="layer-copy"):
        Layout((ExpertSpec("lora", "shared"),), RouterSpec("instance-policy"), "layer-copies")

    without_shape = nn.Module()
    without_shape.net = nn.Linear(2, 2)
    with pytest.raises(UserError, match="small models"):
        attach_layout(without_shape, FLOW_LAYOUT, seed=0)
    raw = yaml.safe_load(TINY_FLOW.read_text())
    raw["flow"]["local_fraction"] = 1.0
    with pytest.raises(UserError, match="local_fraction"):
        validate_recipe(raw)


def test_flow_personalises_most_clients_on_dirichlet_digits(tmp_path):
    """Six clients, digits with Dirichlet label skew α = 0.1 (Flow §5's CIFAR-10 (0.1) setting):
    the routed model beats the global path on most clients (Table 3), and the report says so."""
    result = runner.run_recipe(validate_recipe(yaml.safe_load(TINY_FLOW.read_text())), tmp_path / "run")
    flow = result.summary["methods"]["flow"]
    better = [u for u, values in flow["per_user"].items() if values["score"] > values["score_global"]]
    assert len(better) >= 4, flow["per_user"]
    assert flow["benefiting_pct"] == pytest.approx(100 * len(better) / 6)
    breakdown = sum(flow[f"mean_{key}"] for key in ("global_only", "personal_only", "both_correct",
                                                    "neither_correct"))
    assert breakdown == pytest.approx(100.0)
    assert "% clients Acc_p > Acc_g" in (tmp_path / "run" / "report.md").read_text()


def _global_after_one_round(raw: dict) -> dict[str, torch.Tensor]:
    job = Job(validate_recipe(raw), 0, Path("."))
    trainer = dev.restore_trainer(job, 0, None, RecordDict())
    flow_round(trainer, dev.federated_task(job).train[0], job.recipe.task.batch_size, seed=0)
    return {n: t.clone() for n, t in trainer.model.state_dict().items() if n.startswith("net.") and ".base." in n}


def test_the_codes_global_step_trains_the_global_path_alone_as_fedavgft_does():
    """``global_step: global-path`` (the authors' code) makes the global layers' round independent
    of ψ and the local copies, so they end as FedAvgFT's on Flow's budget (ζ_g); eq. 5's
    ``CE(w_p)`` does not."""
    raw = yaml.safe_load(TINY_FLOW.read_text())
    rounds = {}
    for name, options in (("fedavgft", {"baseline_budget": "flow"}), ("code", {"global_step": "global-path"}),
                          ("paper", {})):
        raw["methods"] = [{"name": "fedavgft" if name == "fedavgft" else "flow", **options}]
        rounds[name] = _global_after_one_round(raw)
    for key, tensor in rounds["fedavgft"].items():
        torch.testing.assert_close(rounds["code"][key], tensor)
    assert any(not torch.equal(rounds["paper"][key], tensor) for key, tensor in rounds["fedavgft"].items())


def test_ditto_keeps_its_personal_copies_between_rounds_and_pulls_them_to_the_received_global_model():
    """Ditto (Li et al. 2021, Alg. 1): the local copies are not restarted after the first round,
    only the global copies leave the device, and a larger λ keeps the personal model nearer
    the global model it received."""
    distances = {}
    for strength in (0.0, 10.0):
        job = Job(load_recipe(TINY_FLOW, ["methods=[ditto]", f"flow.proximal_lambda={strength}"]), 0, Path("."))
        state = RecordDict()
        trainer = dev.restore_trainer(job, 0, None, state)
        examples = dev.federated_task(job).train[0]
        _, weight = flow_round(trainer, examples, job.recipe.task.batch_size, seed=0)
        assert weight == len(examples)
        dev.save_private_state(job, 0, trainer, state, 1)
        tensors, _ = dev.upload(job, trainer)
        assert tensors and not any("private" in name for name in tensors)
        # Next round: the server's global layers differ from the device's personal ones.
        again = dev.restore_trainer(job, 0, None, state)
        assert again.iteration == trainer.iteration > 0, "a returning device does not restart its personal model"
        personal = {n: t.clone() for n, t in again.model.state_dict().items() if ".private_0." in n}
        assert personal and all(torch.equal(personal[n], private_tensors(state)[n]) for n in personal)
        received = {n: t.clone() for n, t in again.model.state_dict().items() if ".base." in n}
        flow_round(again, examples, job.recipe.task.batch_size, seed=1)
        assert again.iteration > trainer.iteration
        distances[strength] = sum(float((again.model.state_dict()[n] - received[n.replace(".private_0.", ".base.")])
                                        .pow(2).sum()) for n in personal)
        assert not torch.equal(again.model.state_dict()[next(iter(personal))],
                               received[next(iter(personal)).replace(".private_0.", ".base.")])
    assert distances[10.0] < 0.5 * distances[0.0], distances


def test_apfl_interpolates_global_and_personal_copies_with_a_private_learned_alpha():
    """APFL (Deng et al. 2020): the personalised model is (1 − α)·w + α·v, α = sigmoid(logit)
    is the device's own and trains, and only the global copies travel."""
    job = Job(load_recipe(TINY_FLOW, ["methods=[apfl]", "flow.interpolation=0.25"]), 0, Path("."))
    trainer = dev.restore_trainer(job, 0, None, RecordDict())
    model, router = trainer.model, instance_policy(trainer.model)
    assert float(torch.sigmoid(router.alpha_logit.detach())) == pytest.approx(0.25)
    with torch.no_grad():
        for _, local in router.pairs:
            for param in local.parameters():
                param.add_(torch.randn_like(param))
    model.eval()
    x = torch.randn(4, *job.recipe.task.spec().input_shape)
    layer = routed_layers(model)[0]
    captured = {}
    layer.register_forward_hook(lambda _m, args, out: captured.update(x=args[0], out=out))
    router.path = "mixture"
    with torch.no_grad():
        model(x)
        expected = 0.75 * layer.base(captured["x"]) + 0.25 * layer.local(captured["x"])
    torch.testing.assert_close(captured["out"], expected)
    router.path = "policy"
    examples = dev.federated_task(job).train[0]
    metrics, weight = flow_round(trainer, examples, job.recipe.task.batch_size, seed=0)
    assert weight == len(examples) and metrics["alpha"] != pytest.approx(0.25, abs=1e-6)
    tensors, _ = dev.upload(job, trainer)
    assert tensors and not any("private" in n or n.startswith("router.") for n in tensors)
    assert "router.alpha_logit" in trainable_state(model)
    assert job.method.role_of("router.alpha_logit").value == "private"


def _trainer(overrides: list[str]) -> tuple[Job, object, object]:
    job = Job(load_recipe(TINY_FLOW, overrides), 0, Path("."))
    return job, dev.restore_trainer(job, 0, None, RecordDict()), dev.federated_task(job).train[0]


@pytest.mark.parametrize("split, fresh", [("per-round", True), ("fixed", False)])
def test_each_round_splits_the_examples_afresh_unless_the_split_is_fixed(split, fresh):
    """Alg. 1 line 6 draws ζ_ℓ, ζ_g inside the round loop (``per-round``); the authors' code
    shards the same way every round (``fixed``)."""
    job, trainer, examples = _trainer([f"flow.zeta_split={split}"])
    procedure = job.method.procedure
    halves = []
    for _ in range(2):
        halves.append(training_rows(procedure, len(examples), round_key(procedure, trainer, seed=0)))
        flow_round(trainer, examples, job.recipe.task.batch_size, seed=0)
    assert torch.equal(halves[0][0], halves[1][0]) is not fresh
    assert set(halves[1][0].tolist()).isdisjoint(halves[1][1].tolist())


@pytest.mark.parametrize("method", ["fedavgft", "ditto", "apfl"])
def test_a_baseline_on_its_papers_budget_trains_both_models_on_every_example_and_on_flows_on_the_halves(method):
    """FedAvgFT as its paper defines it: FedAvg and the fine-tuning each on every example, as
    Ditto's and APFL's two models; ``baseline_budget: flow`` gives them Flow's data per round,
    the global layers on ζ_g and the personal model on ζ_ℓ, and the server weighs |ζ_g|."""
    steps, weights = {}, {}
    for budget in ("paper", "flow"):
        job, trainer, examples = _trainer([f"methods=[{method}]", f"flow.baseline_budget={budget}"])
        _, weights[budget] = flow_round(trainer, examples, job.recipe.task.batch_size, seed=0)
        steps[budget] = trainer.iteration
    count, batch = len(examples), 16
    per_epoch = -(-count // batch)
    epochs = 4  # two epochs of each model (APFL: two epochs of a step of each per batch)
    assert weights == {"paper": count, "flow": count - count // 2} or weights["flow"] == count // 2
    assert steps["paper"] == epochs * per_epoch
    halves = -(-(count // 2) // batch) + -(-(count - count // 2) // batch)
    assert steps["flow"] == epochs // 2 * halves


def test_an_adapted_test_fine_tunes_the_local_copies_and_psi_from_the_received_model_and_repeats():
    """``evaluation: adapted`` (the authors' ``*_generalized_test``): the device tests a copy whose
    local copies restart from the received global layers and train on ζ_ℓ, whose ψ adapts on ζ_g,
    and whose global layers stay, so Acc_g is the received model's; the same copy every time,
    so ``ondevice-moe eval`` repeats it; the model itself is untouched."""
    job, trainer, examples = _trainer(["flow.evaluation=adapted"])
    flow_round(trainer, examples, job.recipe.task.batch_size, seed=0)
    model = trainer.model
    before = {n: t.clone() for n, t in model.state_dict().items()}
    adapted = adapted_for_test(dev.JobDevice(job, 0), model)
    again = adapted_for_test(dev.JobDevice(job, 0), model)
    assert adapted is not model
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} of the device's own model moved"
        assert torch.equal(adapted.state_dict()[name], again.state_dict()[name])
        if name.startswith("net.") and ".base." in name:
            assert torch.equal(adapted.state_dict()[name], tensor), "the global layers do not move"
    router = instance_policy(adapted)
    for global_copy, local_copy in router.pairs:
        assert not torch.equal(global_copy.weight, local_copy.weight), "w_ℓ fine-tuned from w_g"
    psi = [n for n in before if n.startswith("router.")]
    assert psi and any(not torch.equal(adapted.state_dict()[n], before[n]) for n in psi), "ψ adapts"
    scores = evaluate_device(job, 0, model)
    assert scores["user_0/score_global"] == pytest.approx(evaluate_device(
        Job(load_recipe(TINY_FLOW), 0, Path(".")), 0, model)["user_0/score_global"])
    as_trained = Job(load_recipe(TINY_FLOW), 0, Path("."))
    ditto = Job(load_recipe(TINY_FLOW, ["methods=[ditto]", "flow.evaluation=adapted"]), 0, Path("."))
    assert adapted_for_test(dev.JobDevice(as_trained, 0), model) is model
    assert adapted_for_test(dev.JobDevice(ditto, 0), model) is model, "Ditto's personal model is tested as trained"


def test_sgd_takes_the_recipes_momentum_which_adamw_refuses():
    """The authors' Flow code trains with SGD at momentum 0.9 (``training.momentum``)."""
    _, trainer, _ = _trainer(["training.momentum=0.9"])
    assert trainer.expert_optimizer.param_groups[0]["momentum"] == 0.9
    assert trainer.router_optimizer.param_groups[0]["momentum"] == 0.9
    _, plain, _ = _trainer([])
    assert plain.expert_optimizer.param_groups[0]["momentum"] == 0
    with pytest.raises(UserError, match="momentum"):
        load_recipe(TINY_FLOW, ["training.optimizer=adamw", "training.momentum=0.9"])


@pytest.mark.parametrize("method", ["flow", "fedavgft", "ditto", "apfl"])
def test_a_round_logs_every_step_loss_in_the_order_the_steps_ran(method):
    """Each step of the round (local and global, in the order they ran) gives one ``step_losses``
    entry, numbered by the device's step count, so tracking draws Flow's rounds step by step."""
    raw = yaml.safe_load(TINY_FLOW.read_text())
    raw["methods"] = [method]
    job = Job(validate_recipe(raw), 0, Path("."))
    trainer = dev.restore_trainer(job, 0, None, RecordDict())
    start = trainer.iteration
    metrics, _ = flow_round(trainer, dev.federated_task(job).train[0], job.recipe.task.batch_size, seed=0)
    steps = metrics["step_losses"]
    assert len(steps) == metrics["iteration"] - start == trainer.iteration - start > 0
    assert all(isinstance(loss, float) and loss > 0 for loss in steps)
    local, global_ = metrics["train_loss_local"], metrics["train_loss"]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    if method == "apfl":  # a global and a personal step on each pair of batches: some n of them global
        assert any(n * global_ + (len(steps) - n) * local == pytest.approx(sum(steps)) for n in range(len(steps)))
    else:  # Flow and FedAvgFT fine-tune the local copies first; Ditto trains the global layers first
        first, then = (global_, local) if method == "ditto" else (local, global_)
        assert any(mean(steps[:n]) == pytest.approx(first) and mean(steps[n:]) == pytest.approx(then)
                   for n in range(1, len(steps)))
