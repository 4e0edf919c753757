"""FedSoft's LoRA centres (``fedsoft.lora_centres``): eq. (6) on the factors or on the product ``B A``."""

from pathlib import Path

import numpy as np
import pytest
import torch

from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.methods.fedsoft.rule import (
    CentreRule,
    aggregation_weights,
    lora_pairs,
    refactor_product,
    select_clients,
)
from ondevice_moe.recipe import load_recipe
from ondevice_moe.server_rules.aggregation import Update

TINY = Path(__file__).parent / "recipes" / "tiny-fedsoft-lm.yaml"


def _job(tmp_path: Path, mode: str, method: str = "fedsoft") -> Job:
    return Job(load_recipe(TINY, [f"methods=[{method}]", f"fedsoft.lora_centres={mode}"]), 0, tmp_path / "run")


def _client_loras(job: Job, count: int, seed: int, rank_of_update: int | None = None) -> list[dict[str, torch.Tensor]]:
    """``count`` clients' LoRAs on the tiny model, each with its own random ``A`` and ``B``
    (``rank_of_update``: only that many columns of ``B`` nonzero, so ``B A`` has that rank)."""
    reference = dev.upload_reference(job, 0)
    generator = torch.Generator().manual_seed(seed)
    clients = []
    for _ in range(count):
        tensors = {name: torch.randn(tensor.shape, generator=generator) for name, tensor in reference.items()}
        if rank_of_update is not None:
            for name in tensors:
                if name.endswith("lora_B"):
                    tensors[name][:, rank_of_update:] = 0
        clients.append(tensors)
    return clients


def _products(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each LoRA module's effective update ``B A`` (the scale is the same for every model)."""
    return {a: tensors[b].double() @ tensors[a].double() for a, b in lora_pairs(tensors)}


def _aggregate(job: Job, clients, mixtures, examples):
    updates = [Update(k, tensors, n, {"mixture": {"pi": list(mixture)}})
               for k, (tensors, mixture, n) in enumerate(zip(clients, mixtures, examples, strict=True))]
    return job.server_rule.aggregate(job.server_rule.initial_slots(), updates)


MIXTURES = [(0.9, 0.1), (0.2, 0.8)]
EXAMPLES = [30, 50]


def _v() -> np.ndarray:
    return aggregation_weights(np.array(MIXTURES), np.array(EXAMPLES, dtype=float))


def test_the_recipe_option_reaches_every_centred_methods_server_rule(tmp_path):
    for method in ("fedsoft", "ifca", "fedem"):
        assert _job(tmp_path, "product", method).server_rule.lora_centres == "product"
    assert Job(load_recipe(TINY, ["methods=[fedsoft]"]), 0, tmp_path / "run").server_rule.lora_centres == "factors"


def test_product_centres_are_the_v_weighted_mean_of_the_clients_products_eq_6(tmp_path):
    """Two clients with their own ``A`` whose updates have rank 2 each: the mean has rank 4 = r,
    so each centre's ``B A`` is exactly ``Σ_k v_sk B_k A_k``; the two centres differ, and the
    centre of ``factors`` (``A``, ``B`` averaged apart) is not that mean."""
    job = _job(tmp_path, "product")
    clients = _client_loras(job, 2, seed=1, rank_of_update=2)
    slots = _aggregate(job, clients, MIXTURES, EXAMPLES)
    v = _v()
    products = [_products(c) for c in clients]
    centres = [_products(slots[f"cluster_{s}"]) for s in (0, 1)]
    for s in (0, 1):
        for name, got in centres[s].items():
            want = sum(v[s, k] * products[k][name] for k in range(2))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert slots[f"cluster_{s}"][name].shape == clients[0][name].shape  # still rank r
    assert all(not torch.allclose(centres[0][n], centres[1][n], atol=1e-2) for n in centres[0])
    factors = _aggregate(_job(tmp_path, "factors"), clients, MIXTURES, EXAMPLES)
    name = next(iter(centres[0]))
    want = sum(v[0, k] * products[k][name] for k in range(2))
    assert not torch.allclose(_products(factors["cluster_0"])[name], want, atol=1e-2)


def test_beyond_rank_r_a_product_centre_is_the_truncated_svd_of_the_mean_update(tmp_path):
    """Three clients of full rank 4: the mean update has rank 12 > r = 4 and the centre keeps its top
    four singular directions (Eckart–Young), the closest rank-4 update."""
    job = _job(tmp_path, "product")
    clients = _client_loras(job, 3, seed=2)
    mixtures, examples = [(0.5, 0.5), (0.7, 0.3), (0.1, 0.9)], [10, 20, 30]
    slots = _aggregate(job, clients, mixtures, examples)
    v = aggregation_weights(np.array(mixtures), np.array(examples, dtype=float))
    products = [_products(c) for c in clients]
    for name, got in _products(slots["cluster_1"]).items():
        mean = sum(v[1, k] * products[k][name] for k in range(3))
        u, s, vh = torch.linalg.svd(mean)
        torch.testing.assert_close(got, (u[:, :4] * s[:4]) @ vh[:4], rtol=1e-4, atol=1e-4)


def test_clients_sharing_one_a_give_the_same_centre_as_factors(tmp_path):
    """With one ``A`` for every client, ``Σ v_k B_k A = (Σ v_k B_k) A``: ``product`` keeps that ``A``
    and gives the factors ``factors`` gives, so the proximal term of eq. (4) sees the same centre."""
    job = _job(tmp_path, "product")
    clients = _client_loras(job, 2, seed=3)
    for name in clients[1]:
        if name.endswith("lora_A"):
            clients[1][name] = clients[0][name].clone()
    product = _aggregate(job, clients, MIXTURES, EXAMPLES)
    factors = _aggregate(_job(tmp_path, "factors"), clients, MIXTURES, EXAMPLES)
    for s in (0, 1):
        for name, tensor in factors[f"cluster_{s}"].items():
            torch.testing.assert_close(product[f"cluster_{s}"][name], tensor, rtol=1e-4, atol=1e-4)


def test_a_selected_product_centre_is_the_plain_mean_of_the_chosen_clients_products():
    """Alg. 1 lines 16–18 with ``product``: ``ΔW_s = (1/K) Σ_{k ∈ Sel_s} B_k A_k``."""
    generator = torch.Generator().manual_seed(4)
    clients = []
    for _ in range(3):
        b = torch.randn(6, 3, generator=generator)
        b[:, 1:] = 0  # rank-1 updates: three of them fit rank 3
        clients.append({"m.lora_A": torch.randn(3, 5, generator=generator), "m.lora_B": b, "head": torch.randn(2)})
    rule = CentreRule(clusters=1, selection_size=2, seed=0, lora_centres="product")
    updates = [Update(k, c, 10, {"mixture": {"pi": [1.0]}}) for k, c in enumerate(clients)]
    slots = rule.aggregate(rule.initial_slots(), updates)
    factors = CentreRule(clusters=1, selection_size=2, seed=0).aggregate(rule.initial_slots(), updates)
    row = aggregation_weights(np.ones((3, 1)), np.full(3, 10.0))[0]
    chosen = select_clients(row, 2, np.random.default_rng([0, 0, 0]))  # the rule's draw: seed, round, centre
    want = sum(clients[k]["m.lora_B"] @ clients[k]["m.lora_A"] for k in chosen) / 2
    got = slots["cluster_0"]["m.lora_B"] @ slots["cluster_0"]["m.lora_A"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(slots["cluster_0"]["head"], factors["cluster_0"]["head"])


def test_refactoring_keeps_the_factors_near_the_reference_a():
    """The gauge: of the factorisations of one update, the one whose ``A`` is nearest the clients'
    mean ``A`` — here the update's own ``A`` comes back when it is the reference."""
    generator = torch.Generator().manual_seed(5)
    a, b = torch.randn(3, 7, generator=generator), torch.randn(4, 3, generator=generator)
    up, down = refactor_product(b, a, a, 3)
    torch.testing.assert_close(down, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(up, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["factors", "product"])
def test_centres_of_either_mode_load_into_the_model(tmp_path, mode):
    job = _job(tmp_path, mode)
    slots = _aggregate(job, _client_loras(job, 2, seed=6), MIXTURES, EXAMPLES)
    model = dev.build_model(job, 0)
    missing = model.load_state_dict(slots["cluster_0"], strict=False).unexpected_keys
    assert not missing and all(torch.isfinite(t).all() for t in slots["cluster_0"].values())
