"""FLoRAL: adaptors on every layer, the client mixture, preconditioning, π·N aggregation, and a run."""

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml
from flwr.app import RecordDict
from torch import nn

from ondevice_moe import runner
from ondevice_moe.errors import UserError
from ondevice_moe.experts.bias import BiasAdaptor
from ondevice_moe.experts.conv_lora import ConvLoRA
from ondevice_moe.experts.layer import AdaptedLayer, AdaptorKinds, LayerAdaptor, layer_adaptor
from ondevice_moe.experts.lora import LoRA
from ondevice_moe.experts.norm import NormAdaptor
from ondevice_moe.experts.preconditioning import EPSILON, precondition_conv_lora, precondition_lora
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.layout import ExpertSpec, Layout, RouterSpec, attach_layout
from ondevice_moe.methods.floral.rule import MixtureRule
from ondevice_moe.methods.registry import method_for
from ondevice_moe.models.heads import head_paths
from ondevice_moe.models.small import small_model
from ondevice_moe.recipe import load_recipe, validate_recipe
from ondevice_moe.routing import client_mixture
from ondevice_moe.server_rules.aggregation import Update, average
from ondevice_moe.training import DeviceTrainer, TrainingConfig, trainable_state

TINY_FLORAL = Path(__file__).parent / "recipes" / "tiny-floral.yaml"


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _adapted(layer: nn.Module, kinds: AdaptorKinds) -> AdaptedLayer:
    adapted = AdaptedLayer(layer)
    adapted.add("shared_0", layer_adaptor(layer, kinds, _generator()), lambda: torch.tensor(1.0))
    return adapted


def _perturb(module: nn.Module) -> None:
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn(param.shape, generator=_generator()) * 0.1)


@pytest.mark.parametrize(("layer", "inputs"), [
    (nn.Linear(12, 6), torch.randn(3, 12)),
    (nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.randn(2, 3, 9, 9)),
    (nn.LayerNorm(12), torch.randn(3, 12)),
    (nn.GroupNorm(2, 4), torch.randn(2, 4, 5, 5)),
    (nn.BatchNorm2d(4), torch.randn(2, 4, 5, 5)),
    (nn.RMSNorm(12), torch.randn(3, 12)),
])
@pytest.mark.parametrize("conv", ["balanced-2d", "channel"])
def test_each_adaptor_kind_fresh_leaves_its_layer_unchanged_and_trained_changes_it(layer, inputs, conv):
    layer.eval()
    adapted = _adapted(layer, AdaptorKinds(budget=0.5, conv=conv, norm=True)).eval()
    torch.testing.assert_close(adapted(inputs), layer(inputs))
    _perturb(adapted.adapters)
    assert not torch.allclose(adapted(inputs), layer(inputs))
    assert adapted(inputs).shape == layer(inputs).shape


def test_the_pieces_follow_the_layer_type():
    kinds = AdaptorKinds(budget=0.1, norm=True)
    assert set(layer_adaptor(nn.Linear(4, 4), kinds, _generator())) == {"lora", "bias"}
    assert set(layer_adaptor(nn.Linear(4, 4, bias=False), kinds, _generator())) == {"lora"}
    assert set(layer_adaptor(nn.Conv2d(2, 4, 3), kinds, _generator())) == {"lora", "bias"}
    assert set(layer_adaptor(nn.LayerNorm(4), kinds, _generator())) == {"norm"}
    assert layer_adaptor(nn.ReLU(), kinds, _generator()) is None
    assert layer_adaptor(nn.LayerNorm(4), AdaptorKinds(), _generator()) is None  # norm adaptors are off by default
    assert isinstance(layer_adaptor(nn.Conv2d(2, 4, 3), kinds, _generator())["bias"], BiasAdaptor)
    assert isinstance(layer_adaptor(nn.BatchNorm1d(4), kinds, _generator())["norm"], NormAdaptor)


def test_lora_rank_follows_the_relative_budget():
    # §3.2: r = max(1, ⌊ρ·mn/(m+n)⌋)
    lora = layer_adaptor(nn.Linear(64, 32), AdaptorKinds(budget=0.1), _generator())["lora"]
    assert lora.rank == int(0.1 * 64 * 32 / 96) == 2
    assert layer_adaptor(nn.Linear(64, 32), AdaptorKinds(budget=0.001), _generator())["lora"].rank == 1
    assert lora.scaling == 1.0  # W + UVᵀ, unscaled


def test_conv_lora_rank_and_shapes_follow_app_f1():
    base = nn.Conv2d(16, 32, 3, stride=2, padding=1)
    balanced = ConvLoRA(base, 0.1, "balanced-2d", _generator())
    # (c_in·k2 + c_out·k1)·r ≤ ρ·c_in·c_out·k1·k2: r = ⌊0.1·4608 / 144⌋ = 3
    assert balanced.rank == 3
    assert balanced.down.weight.shape == (3, 16, 1, 3) and balanced.up.weight.shape == (32, 3, 3, 1)
    assert sum(p.numel() for p in balanced.parameters()) == (16 * 3 + 32 * 3) * 3
    channel = ConvLoRA(base, 0.1, "channel", _generator())
    # (c_out·k1·k2 + c_in)·r: r = ⌊460.8 / 304⌋ = 1
    assert channel.rank == 1
    assert channel.down.weight.shape == (1, 16, 1, 1) and channel.up.weight.shape == (32, 1, 3, 3)
    x = torch.randn(2, 16, 11, 11)
    for lora in (balanced, channel):
        assert lora(x).shape == base(x).shape
        assert torch.count_nonzero(lora(x)) == 0


def test_lora_preconditioning_follows_eq_36():
    lora = LoRA(5, 4, rank=2, alpha=2.0, rank_stabilised=False)
    with torch.no_grad():
        lora.lora_B.copy_(torch.randn(4, 2, generator=_generator()))
    x = torch.randn(7, 5, generator=_generator())
    lora(x).pow(2).sum().backward()
    grad_down, grad_up = lora.lora_A.grad.clone(), lora.lora_B.grad.clone()
    precondition_lora(lora)
    u, v_t = lora.lora_B.detach(), lora.lora_A.detach()  # U (out × r), Vᵀ (r × in)
    eye = torch.eye(2) * EPSILON
    # G_U ← G_U (VᵀV + εI)⁻¹ and G_V ← G_V (UᵀU + εI)⁻¹ (here for Vᵀ: (UᵀU + εI)⁻¹ G_Vᵀ)
    torch.testing.assert_close(lora.lora_B.grad, grad_up @ torch.linalg.inv(v_t @ v_t.T + eye))
    torch.testing.assert_close(lora.lora_A.grad, torch.linalg.inv(u.T @ u + eye) @ grad_down)


def test_conv_lora_preconditioning_divides_by_the_gram_norms():
    lora = ConvLoRA(nn.Conv2d(2, 3, 3), 1.0, "balanced-2d", _generator())
    with torch.no_grad():
        lora.up.weight.normal_(generator=_generator())
    lora(torch.randn(1, 2, 6, 6, generator=_generator())).sum().backward()
    grad_down = lora.down.weight.grad.clone()
    precondition_conv_lora(lora)
    gram = torch.einsum("ma...,mb...->ab...", lora.up.weight, lora.up.weight)
    torch.testing.assert_close(lora.down.weight.grad, grad_down / (torch.linalg.norm(gram) + EPSILON))


def test_adaptors_are_mixed_by_pi_and_pi_star_is_one_hot():
    net = small_model("mlp", (6,), 3, hidden=(5,))
    experts = (ExpertSpec("layers", "shared"),) * 2
    model = attach_layout(net, Layout(experts, RouterSpec("client-mixture"), "every-layer"), seed=0)
    layer = model.net[1]
    with torch.no_grad():
        model.router.theta.copy_(torch.tensor([0.3, -0.2]))
        for adaptor in layer.adapters.values():
            _perturb(adaptor)
    x = torch.randn(4, 6, generator=_generator())
    pi = torch.softmax(torch.tensor([0.3, -0.2]), 0)
    out = layer.base(x)
    residuals = [adaptor["lora"](x) + adaptor["bias"](x, out) for adaptor in layer.adapters.values()]
    expected = out + sum(p * residual for p, residual in zip(pi, residuals, strict=True))
    torch.testing.assert_close(layer(x), expected)
    optimal = attach_layout(net, Layout(experts, RouterSpec("client-mixture", optimal=1), "every-layer"), seed=0)
    assert optimal.router.mixture().tolist() == [0.0, 1.0]
    assert not any(name.startswith("router") for name, _ in optimal.named_parameters())


def test_ensemble_mixes_whole_models_that_start_apart():
    net = small_model("mlp", (6,), 3, hidden=(5,))
    layout = Layout((ExpertSpec("model", "shared"),) * 2, RouterSpec("client-mixture"), "ensemble")
    model = attach_layout(net, layout, seed=0)
    first, second = model.net.experts.values()
    assert not torch.equal(first[1].weight, second[1].weight)
    x = torch.randn(4, 6, generator=_generator())
    torch.testing.assert_close(model(inputs=x).logits, 0.5 * first(x) + 0.5 * second(x))
    again = attach_layout(net, layout, seed=0, user=5)  # shared experts start the same on every device
    assert torch.equal(again.net.experts["shared_1"][1].weight, second[1].weight)


def test_the_server_weighs_adaptor_c_by_pi_c_times_examples():
    first = Update(0, {"u": torch.tensor([1.0]), "a.shared_0.w": torch.tensor([2.0]),
                       "a.shared_1.w": torch.tensor([4.0])}, 10, {"mixture": {"pi": [0.25, 0.75]}})
    second = Update(1, {"u": torch.tensor([3.0]), "a.shared_0.w": torch.tensor([6.0]),
                        "a.shared_1.w": torch.tensor([8.0])}, 30, {"mixture": {"pi": [0.5, 0.5]}})
    merged = average([first, second], MixtureRule("num_examples").weights())
    assert merged["u"].item() == pytest.approx((10 * 1 + 30 * 3) / 40)
    assert merged["a.shared_0.w"].item() == pytest.approx((2.5 * 2 + 15 * 6) / (2.5 + 15))
    assert merged["a.shared_1.w"].item() == pytest.approx((7.5 * 4 + 15 * 8) / (7.5 + 15))


def test_an_adaptor_no_client_weighs_keeps_its_value():
    only = Update(0, {"a.shared_0.w": torch.tensor([2.0]), "a.shared_1.w": torch.tensor([4.0])}, 10,
                  {"mixture": {"pi": [1.0, 0.0]}})
    assert set(average([only], MixtureRule().weights())) == {"a.shared_0.w"}


def _tiny_job(index: int = 0) -> Job:
    return Job(load_recipe(TINY_FLORAL), index, Path("."))


def test_theta_stays_on_the_device_and_pi_travels_with_the_update():
    job = _tiny_job()
    trainer = dev.restore_trainer(job, 1, None, RecordDict())
    metrics, _ = dev.run_local_procedure(job, 1, trainer, seed=0)
    tensors, records = dev.upload(job, trainer)
    assert "router.theta" in dict(trainer.model.named_parameters())
    assert not any("router" in name for name in tensors)
    assert any(".base." in name for name in tensors) and any("shared_1" in name for name in tensors)
    pi = torch.softmax(trainer.model.router.theta.detach(), 0).tolist()
    assert records["mixture"]["pi"] == pytest.approx(pi)
    assert pi != pytest.approx([0.5, 0.5], abs=1e-6), "θ trains with the model"
    assert metrics["pi_0"] == pytest.approx(pi[0])


@pytest.mark.parametrize("router_lr", [None, 0.5])
def test_theta_trains_at_its_own_rate_when_given_one(router_lr):
    method = method_for("floral", 2, clusters=2, router_lr=router_lr)
    net = small_model("mlp", (6,), 3, hidden=(5,))
    model = attach_layout(net, method.layouts[0], seed=0)
    trainer = DeviceTrainer(model, method, TrainingConfig(lr=0.01, lr_schedule="constant", optimizer="sgd",
                                                          grad_clip=None))
    theta = model.router.theta
    batch = {"inputs": torch.randn(8, 6, generator=_generator()), "labels": torch.arange(8) % 3}
    trainer.expert_step(batch)  # fresh adaptors do nothing, so θ has no gradient until they have trained
    loss = nn.functional.cross_entropy(model(inputs=batch["inputs"]).logits, batch["labels"])
    gradient = torch.autograd.grad(loss, theta)[0]
    assert gradient.abs().sum() > 0
    trainer.expert_step(batch)
    torch.testing.assert_close(theta.detach(), -(router_lr or 0.01) * gradient, atol=1e-6, rtol=1e-4)


def test_router_noise_is_drawn_once_per_training_pass_as_the_authors_code():
    method = method_for("floral", 2, clusters=2, router_noise=1.0)
    assert method.name == "floral-1pct-noise1"
    model = attach_layout(small_model("mlp", (6,), 3, hidden=(5,)), method.layouts[0], seed=0)
    with torch.no_grad():
        model.router.theta.copy_(torch.tensor([0.3, -0.2]))
        for name, module in model.named_modules():
            if name.endswith("shared_0") or name.endswith("shared_1"):
                _perturb(module)
    x = torch.randn(4, 6, generator=_generator())
    model.train()
    torch.manual_seed(0)
    noisy = model(inputs=x).logits
    drawn = model.router.drawn.clone()
    assert drawn.min() >= 0 and drawn.max() < 1 and drawn.abs().sum() > 0
    assert client_mixture(model) == pytest.approx(torch.softmax(torch.tensor([0.3, -0.2]), 0).tolist())
    model(inputs=x)
    assert not torch.equal(model.router.drawn, drawn), "a new pass draws new noise"
    model.eval()
    clean = model(inputs=x).logits
    assert model.router.drawn is None
    with torch.no_grad():
        model.router.theta.add_(drawn)
    torch.testing.assert_close(model(inputs=x).logits, noisy)  # every layer read the one draw
    assert not torch.allclose(clean, noisy)
    twin = copy.deepcopy(model).train()
    twin(inputs=x)
    assert twin.router.drawn.abs().sum() > 0 and model.router.drawn is None, "a copy draws its own noise"
    assert not any("drawn" in name for name in trainable_state(model)), "the noise is never kept or sent"


def test_without_noise_theta_is_read_as_it_is_in_training():
    model = attach_layout(small_model("mlp", (6,), 3, hidden=(5,)), method_for("floral", 2, clusters=2).layouts[0],
                          seed=0)
    model.train()
    model(inputs=torch.randn(4, 6, generator=_generator()))
    assert model.router.drawn is None
    assert model.router.mixture().tolist() == [0.5, 0.5]


def test_floral_without_clusters_says_how_to_set_them():
    with pytest.raises(UserError, match="set `clusters`"):
        method_for("floral", 4)
    assert len(method_for("floral", 4, clusters=3).layouts[0].experts) == 3


def test_ensemble_refuses_hugging_face_models():
    raw = yaml.safe_load(TINY_FLORAL.read_text())
    raw["model"], raw["task"] = {"name": "tiny-bert"}, {"name": "sst2", "clients": 2}
    raw["methods"] = ["ensemble"]
    with pytest.raises(UserError, match=r"do not run|small"):
        validate_recipe(raw)


def test_floral_ends_below_fedavg_on_two_clusters_of_linear_maps(tmp_path):
    """A tiny MLP on four clients in two clusters whose targets differ by a rank-1 map: one
    global model cannot fit both, FLoRAL's mixture of two adaptors can (FLoRAL Table 3's ordering)."""
    result = runner.run_recipe(load_recipe(TINY_FLORAL), tmp_path / "run")
    methods = result.summary["methods"]
    assert methods["floral-10pct"]["mean_score"] < 0.5 * methods["fedavg"]["mean_score"], methods
    pis = {}
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train" and record["method"] == "floral-10pct":
            pis[record["user"]] = record["pi_0"]
    # clients 0 and 2 share a cluster, 1 and 3 the other: each pair leans to one expert, the pairs to different ones
    lean = {user: pi - 0.5 for user, pi in pis.items()}
    assert lean["client_0"] * lean["client_2"] > 0 and lean["client_1"] * lean["client_3"] > 0, pis
    assert lean["client_0"] * lean["client_1"] < 0, pis


def test_floral_on_a_hugging_face_model_adapts_every_layer_of_its_blocks(tiny_model, tokens):
    from transformers.pytorch_utils import Conv1D

    kinds = AdaptorKinds(budget=0.05, norm=True)
    layout = Layout((ExpertSpec("layers", "shared"),) * 2, RouterSpec("client-mixture"), "every-layer",
                    adaptor_kinds=kinds)
    model = attach_layout(tiny_model, layout, seed=0)
    torch.testing.assert_close(model(tokens).logits, tiny_model(tokens).logits)
    linears = [m for m in tiny_model.modules() if isinstance(m, nn.Linear | Conv1D)]
    adapted = [m.base for m in model.modules() if isinstance(m, AdaptedLayer)]
    head = 1  # the language-model head sits outside the blocks and keeps its weights
    assert sum(isinstance(m, nn.Linear | Conv1D) for m in adapted) == len(linears) - head
    assert any(type(m).__name__.endswith(("LayerNorm", "RMSNorm")) for m in adapted)
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    assert "router.theta" in trainable
    assert all(".adapters.shared_" in name or name == "router.theta" for name in trainable)


def test_floral_adapts_a_classifier_head_too():
    from ondevice_moe.models import load_base_model

    base = load_base_model("tiny-bert", num_labels=3).model
    layout = Layout((ExpertSpec("layers", "shared"),) * 2, RouterSpec("client-mixture"), "every-layer",
                    adaptor_kinds=AdaptorKinds(budget=0.1))
    heads = head_paths(base)
    model = attach_layout(base, layout, seed=0, own=heads)
    assert isinstance(model.classifier, AdaptedLayer)
    tokens = torch.randint(5, 100, (2, 8), generator=_generator())
    torch.testing.assert_close(model(input_ids=tokens).logits, base(input_ids=tokens).logits)


def test_head_rank_sets_the_classifier_heads_lora_rank_and_leaves_the_blocks_to_the_budget():
    from ondevice_moe.models import load_base_model

    base = load_base_model("tiny-bert", num_labels=3).model
    heads = head_paths(base)
    ranks = {}
    for head_rank in (None, 3):
        method = method_for("floral", 2, clusters=2, budget=0.01, head_rank=head_rank)
        model = attach_layout(base, method.layouts[0], seed=0, own=heads)
        ranks[head_rank] = {name: module.lora.rank for name, module in model.named_modules()
                            if isinstance(module, LayerAdaptor) and module.low_rank is not None}
    head = [name for name in ranks[3] if name.startswith(heads)]
    blocks = [name for name in ranks[3] if not name.startswith(heads)]
    assert head and blocks
    assert all(ranks[None][name] == 1 for name in head) and all(ranks[3][name] == 3 for name in head)
    assert all(ranks[3][name] == ranks[None][name] for name in blocks)


def test_the_spelled_out_mixture_holds_a_private_adaptor_beside_a_shared_one():
    raw = yaml.safe_load(TINY_FLORAL.read_text())
    raw["methods"] = [{"name": "mixture", "experts": [{"kind": "layers", "role": "shared"},
                                                      {"kind": "layers", "role": "private"}],
                       "router": "client-mixture", "mixing": "every-layer", "routers_train": "joint",
                       "aggregation": "mixture-weighted", "budget": 0.1}]
    job = Job(validate_recipe(raw), 0, Path("."))
    assert isinstance(job.server_rule, MixtureRule)
    trainer = dev.restore_trainer(job, 0, None, RecordDict())
    dev.run_local_procedure(job, 0, trainer, seed=0)
    tensors, records = dev.upload(job, trainer)
    assert any("shared_0" in name for name in tensors) and not any("private_0" in name for name in tensors)
    assert any("private_0" in name for name, _ in trainer.model.named_parameters())
    assert len(records["mixture"]["pi"]) == 2


def test_transformer_sites_on_a_small_model_are_refused_with_the_fix():
    raw = yaml.safe_load(TINY_FLORAL.read_text())
    raw["methods"] = [{"name": "mixture", "experts": [{"kind": "lora"}], "router": "none", "mixing": "block"}]
    with pytest.raises(UserError, match="mixing: every-layer"):
        dev.build_model(Job(validate_recipe(raw), 0, Path(".")), 0)


@pytest.mark.parametrize("method", ["floral", {"name": "floral", "optimal_routing": True}, "ensemble",
                                    {"name": "ensemble", "optimal_routing": True}], ids=str)
def test_every_client_mixture_sends_its_pi_for_the_servers_weights(method):
    """The server weighs expert c by π_c (Alg. 1 line 12) only if π travels: the Ensemble's too (it once
    sent none, and its π* runs averaged every cluster's model over all clients)."""
    job = Job(load_recipe(TINY_FLORAL, [f"methods=[{json.dumps(method)}]"]), 0, Path("."))
    trainer = dev.restore_trainer(job, 1, None, RecordDict())
    pi = dev.upload(job, trainer)[1]["mixture"]["pi"]
    assert len(pi) == 2 and sum(pi) == pytest.approx(1.0)
    if isinstance(method, dict):  # π*: the device's own cluster, one-hot
        assert sorted(pi) == [0.0, 1.0]
