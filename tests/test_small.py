"""Small tasks (FLoRAL App. G, FedSoft §5, digits), small models, devices, quantized classifier heads."""

from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn

from ondevice_moe.data.small import (
    SMALL_TASKS,
    build_small_task,
    check_small_options,
    fedsoft_mixtures,
    mixture_counts,
)
from ondevice_moe.data.tasks import TASKS
from ondevice_moe.errors import UserError
from ondevice_moe.metrics import mean_squared_error
from ondevice_moe.models.devices import resolve_device
from ondevice_moe.models.registry import load_base_model
from ondevice_moe.models.small import small_model
from ondevice_moe.models.tiny import byte_tokenizer, tiny_model

# ---------------------------------------------------------------- generators


def _tensors(task):
    return [t for split in (task.train, task.test, task.cluster_test) for e in split for t in (e.inputs, e.labels)]


@pytest.mark.parametrize("name", SMALL_TASKS)
def test_small_tasks_are_reproducible_from_the_seed(name):
    first, again, other = (build_small_task(name, seed=seed) for seed in (3, 3, 4))
    assert first.task is TASKS[name]
    assert len(first.train) == len(first.test) == TASKS[name].clients
    assert all(torch.equal(a, b) for a, b in zip(_tensors(first), _tensors(again), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(_tensors(first), _tensors(other), strict=True))
    for examples in first.train + first.test:
        assert examples.inputs.shape[1:] == TASKS[name].input_shape
        batch = examples.batch(torch.tensor([1, 0]))
        assert set(batch) == {"inputs", "labels"}
        assert torch.equal(batch["labels"], examples.labels[[1, 0]])


def _least_squares(task, cluster):
    """The linear map fitted to all training data of one cluster, and the largest residual."""
    members = [e for e, m in zip(task.train, task.mixtures, strict=True) if m[cluster] == 1]
    inputs = torch.cat([e.inputs for e in members]).double()
    outputs = torch.cat([e.labels for e in members]).double()
    solution = torch.linalg.lstsq(inputs, outputs).solution
    return solution.T, float((inputs @ solution - outputs).abs().max())


def test_floral_linear_follows_eq_9():
    task = build_small_task("floral-linear", seed=0)
    assert len(task.train) == 10  # K = 10, C = 2 (FLoRAL §6)
    np.testing.assert_array_equal(task.mixtures, np.eye(2)[[k % 2 for k in range(10)]])  # π^k_c = δ_(k mod C)c
    for examples in task.train:
        assert examples.inputs.shape == (25, 10) and examples.labels.shape == (25, 10)  # N^k = 0.25 d, d = 100
    maps = []
    for cluster in range(2):
        weights, residual = _least_squares(task, cluster)
        assert residual < 1e-4  # y = (W + α U_c V_cᵀ) x exactly, no noise
        maps.append(weights)
        cluster_test = task.cluster_test[cluster]
        assert torch.allclose(cluster_test.inputs.double() @ weights.T, cluster_test.labels.double(), atol=1e-4)
    # the clusters differ by α (U_0 V_0ᵀ − U_1 V_1ᵀ): rank 2r = 2 of 10
    assert torch.linalg.matrix_rank(maps[0] - maps[1], atol=1e-6) == 2


def test_floral_mlp_is_a_relu_net_with_k_20_c_4():
    task = build_small_task("floral-mlp", seed=0)
    assert len(task.train) == 20 and task.mixtures.shape == (20, 4)
    assert [int(m.argmax()) for m in task.mixtures] == [k % 4 for k in range(20)]
    assert all(e.inputs.shape == (100, 10) for e in task.train)  # N^k = 0.5 d, d = 10·10 + 10·10
    _, residual = _least_squares(task, 0)
    assert residual > 0.1  # Φ (·)_+ is not linear in x


def test_fedsoft_partitions_match_section_5():
    rng = np.random.default_rng(0)
    ten_ninety = fedsoft_mixtures("10-90", 100, 2, rng)
    assert (ten_ninety[:50] == [0.1, 0.9]).all() and (ten_ninety[50:] == [0.9, 0.1]).all()
    assert (fedsoft_mixtures("30-70", 100, 2, rng)[:50] == [0.3, 0.7]).all()
    linear = fedsoft_mixtures("linear", 100, 2, rng)
    np.testing.assert_allclose(linear[:, 0], (0.5 + np.arange(100)) / 100)  # (0.5 + k) % from D_A
    shares = fedsoft_mixtures("random", 7, 5, rng)
    assert shares.shape == (7, 5) and (shares >= 0).all()
    np.testing.assert_allclose(shares.sum(axis=1), 1.0)
    assert mixture_counts(np.array([0.1, 0.9]), 150).tolist() == [15, 135]
    assert mixture_counts(np.array([1 / 3] * 3), 10).tolist() == [4, 3, 3]


def test_fedsoft_clients_hold_the_stated_source_mix():
    task = build_small_task("fedsoft-10-90", seed=1)
    assert len(task.train) == 100
    assert all(100 <= len(e) <= 200 and e.labels.shape == (len(e), 1) for e in task.train)
    # θ_s from the sources' own held-out sets (noise ε ~ N(0, 1) against σ₀ = 10)
    thetas = [torch.linalg.lstsq(s.inputs.double(), s.labels.double()).solution for s in task.cluster_test]
    assert all(float(theta.std()) > 3 for theta in thetas)
    for client in (0, 99):
        examples = task.train[client]
        residuals = torch.cat([(examples.inputs.double() @ t - examples.labels).abs() for t in thetas], dim=1)
        share_a = float((residuals.argmin(dim=1) == 0).double().mean())
        assert share_a == pytest.approx(task.mixtures[client][0], abs=0.05)


def test_fedsoft_random_takes_more_sources():
    task = build_small_task("fedsoft-random", clients=6, clusters=3, seed=0)
    assert task.mixtures.shape == (6, 3) and len(task.cluster_test) == 3


def _originals():
    from sklearn.datasets import load_digits

    digits = load_digits()
    return {(image / 16.0).astype(np.float32).tobytes(): int(label) for image, label in
            zip(digits.images, digits.target, strict=True)}


@pytest.mark.parametrize(("name", "turns", "shift"),
                         [("digits-rotate", 1, 0), ("digits-label-shift", 0, 1), ("digits-rotate-label-shift", 1, 1)])
def test_digits_clusters_are_exact_rotations_and_label_shifts(name, turns, shift):
    task = build_small_task(name, seed=0)
    assert len(task.train) == 20 and len(task.cluster_test) == 4
    assert sum(map(len, task.train)) == 1438 and sum(map(len, task.test)) == 359  # 80 / 20 of 1,797
    plain = task.cluster_test[0]
    for cluster, examples in enumerate(task.cluster_test):
        expected = torch.rot90(plain.inputs, k=cluster * turns, dims=(2, 3))
        assert torch.equal(examples.inputs, expected)
        assert torch.equal(examples.labels, (plain.labels + cluster * shift) % 10)
    originals = _originals()
    for client, examples in enumerate(task.train[:8]):
        cluster = client % 4
        assert task.mixtures[client][cluster] == 1
        for image, label in zip(examples.inputs[:, 0].numpy(), examples.labels.tolist(), strict=True):
            restored = np.ascontiguousarray(np.rot90(image, k=-cluster * turns)).tobytes()
            assert (originals[restored] + cluster * shift) % 10 == label


def test_digits_reduced_keeps_five_percent_at_least_ten():
    full = build_small_task("digits-rotate", clients=4, seed=2)
    reduced = build_small_task("digits-rotate", clients=4, seed=2, data_fraction=0.05)
    for whole, part in zip(full.train, reduced.train, strict=True):
        assert len(part) == max(10, round(0.05 * len(whole)))  # 360 examples each → 18
        rows = {row.numpy().tobytes() for row in whole.inputs}
        assert all(row.numpy().tobytes() in rows for row in part.inputs)
    assert [len(e) for e in build_small_task("digits-rotate", seed=2, data_fraction=0.05).train] == [10] * 20
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(full.test, reduced.test, strict=True))


def test_digits_dirichlet_skews_labels():
    def mean_top_share(task):
        return np.mean([Counter(e.labels.tolist()).most_common(1)[0][1] / len(e) for e in task.train])

    skewed = build_small_task("digits-dirichlet", clients=10, alpha=0.1, seed=0)
    even = build_small_task("digits-dirichlet", clients=10, alpha=100.0, seed=0)
    assert skewed.mixtures is None and skewed.cluster_test == []
    assert sum(map(len, skewed.train)) == 1438
    assert mean_top_share(skewed) > 0.4 > 0.2 > mean_top_share(even)


def test_every_digits_client_gets_test_and_validation_digits_when_a_redraw_allows_it():
    # Seed 4's first Dirichlet draw leaves a client of 20 with no test digit, which would score it 0.
    for seed in range(5):
        task = build_small_task("digits-dirichlet", clients=30, alpha=0.1, seed=seed, valid_examples=250)
        assert min(map(len, task.test)) >= 1 and min(map(len, task.valid)) >= 1 and min(map(len, task.train)) >= 2
    assert min(map(len, build_small_task("digits-dirichlet", clients=20, alpha=0.1, seed=4).test)) >= 1


def test_digits_clients_that_no_draw_can_give_test_digits_are_named():
    with pytest.raises(UserError, match=r"clients? [\d, ]+ of 50 would get no test examples") as caught:
        build_small_task("digits-dirichlet", clients=50, alpha=0.1, seed=0, valid_examples=250)
    assert "task.dirichlet_alpha" in caught.value.fix


@pytest.mark.parametrize(
    ("name", "clusters", "message"),
    [("digits-rotate", 5, "1 to 4 clusters"), ("digits-label-shift", 11, "1 to 10"),
     ("fedsoft-30-70", 3, "exactly 2"), ("digits-dirichlet", 2, "no clusters"), ("sst2", None, "text task")],
)
def test_small_options_are_checked(name, clusters, message):
    with pytest.raises(UserError, match=message):
        check_small_options(TASKS[name], None, clusters)


# ---------------------------------------------------------------- models


def _train(model, batch, steps=40, lr=1e-2):
    model.requires_grad_(True).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    first = float(model(**batch).loss.detach())
    for _ in range(steps):
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
    return first, float(model(**batch).loss.detach())


@pytest.mark.parametrize("kind", ["linear", "mlp", "cnn"])
def test_small_classifiers_train_on_digits(kind):
    examples = build_small_task("digits-rotate", seed=0).train[0]
    loaded = load_base_model(kind, num_labels=10, input_shape=(1, 8, 8), seed=0)
    assert loaded.tokenizer is None
    assert not any(p.requires_grad for p in loaded.model.parameters()) and not loaded.model.training
    batch = examples.batch(torch.arange(len(examples)))
    output = loaded.model(**batch)
    assert output.logits.shape == (len(examples), 10)
    assert float(output.loss) == pytest.approx(float(nn.functional.cross_entropy(output.logits, batch["labels"])))
    assert loaded.model(inputs=batch["inputs"]).loss is None
    first, last = _train(loaded.model, batch)
    assert last < 0.5 * first


def test_small_regressor_trains_with_mse():
    examples = build_small_task("floral-linear", seed=0).train[0]
    model = load_base_model("linear", num_labels=10, input_shape=(10,), regression=True,
                            model_options={"bias": False}).model
    assert [name for name, _ in model.named_parameters()] == ["net.1.weight"]
    batch = examples.batch(torch.arange(len(examples)))
    output = model(**batch)
    assert float(output.loss) == pytest.approx(mean_squared_error(output.logits.detach(), batch["labels"]))
    first, last = _train(model, batch, steps=100)
    assert last < 0.2 * first


def test_small_models_are_seeded_and_leave_the_global_generator_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = small_model("mlp", (64,), 10, seed=5, hidden=(32, 16))
    assert torch.equal(torch.rand(1), before)
    b, c = small_model("mlp", (64,), 10, seed=5, hidden=(32, 16)), small_model("mlp", (64,), 10, seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert [p.shape for p in a.parameters()][::2] == [(32, 64), (16, 32), (10, 16)]
    assert not torch.equal(next(a.parameters())[:32], next(c.parameters())[:32])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_labels": 10, "input_shape": (64,), "quantization": "nf4"}, "cannot be quantized"),
     ({"num_labels": None, "input_shape": None}, "not a language model"),
     ({"num_labels": 10, "input_shape": (1, 8, 8), "model_options": {"depth": 3}}, "bad options")],
)
def test_small_model_misuse_raises_user_error(kwargs, message):
    with pytest.raises(UserError, match=message):
        load_base_model("mlp", **kwargs)


def test_cnn_needs_images():
    with pytest.raises(UserError, match="channels, height, width"):
        small_model("cnn", (64,), 10)
    with pytest.raises(UserError, match="cannot shrink"):
        small_model("cnn", (1, 2, 2), 10)


# ---------------------------------------------------------------- devices


def test_a_bfloat16_base_on_a_cpu_that_emulates_bfloat16_is_named_with_its_fix(monkeypatch):
    from ondevice_moe import api
    from ondevice_moe.models import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(devices, "native_bfloat16_cpu", lambda: False)
    assert "model.dtype=float32" in devices.slow_bfloat16("bfloat16", "auto")
    assert devices.slow_bfloat16("float32", "cpu") is None
    recipe = api.load_recipe("quickstart", {"model.dtype": "bfloat16"})
    with pytest.warns(UserWarning, match="no native bfloat16"):
        api._warn_if_slow_bfloat16(recipe)
    assert api.load_recipe("quickstart").model.dtype == "float32"  # `dtype: auto` on this CPU
    monkeypatch.setattr(devices, "native_bfloat16_cpu", lambda: True)
    assert devices.slow_bfloat16("bfloat16", "cpu") is None
    assert api.load_recipe("quickstart").model.dtype == "bfloat16"
    monkeypatch.setattr(devices, "native_bfloat16_cpu", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.slow_bfloat16("bfloat16", "auto") is None  # on the GPU


def test_resolve_device(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UserError, match="no CUDA GPU") as error:
        resolve_device("cuda")
    assert "auto" in error.value.fix
    with pytest.raises(UserError, match="tpu"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda") == torch.device("cuda")


def test_load_base_model_places_the_model(monkeypatch):
    loaded = load_base_model("tiny-bert", num_labels=2, device="auto" if not torch.cuda.is_available() else "cpu")
    assert {p.device for p in loaded.model.parameters()} == {torch.device("cpu")}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="cuda"):
        load_base_model("mlp", num_labels=2, input_shape=(4,), device="cuda")


# ---------------------------------------------------------------- quantized classifiers


@pytest.fixture(scope="module")
def tiny_bert_folder(tmp_path_factory):
    """A tiny random BERT encoder (no head) and its tokenizer, saved like a pretrained model."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    tiny_model("tiny-bert", len(tokenizer), num_labels=2).bert.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("quantization", "layer"), [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_quantized_classifier_keeps_head_and_pooler_trainable(tiny_bert_folder, quantization, layer):
    loaded = load_base_model(str(tiny_bert_folder), quantization=quantization, num_labels=3, seed=0)
    model = loaded.model
    query = model.bert.encoder.layer[0].attention.self.query
    assert type(query).__name__ == layer and not query.weight.dtype.is_floating_point
    assert type(model.classifier) is nn.Linear and type(model.bert.pooler.dense) is nn.Linear
    assert model.classifier.weight.dtype == torch.float32
    heads = [model.classifier, model.bert.pooler]
    for head in heads:
        head.requires_grad_(True)  # raised "only Tensors of floating point dtype can require gradients" before
    batch = loaded.tokenizer(["a fine film", "dull"], padding=True, return_tensors="pt")
    model.train()
    model(**batch, labels=torch.tensor([0, 2])).loss.backward()
    for head in heads:
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
    assert query.weight.grad is None and not query.weight.dtype.is_floating_point
