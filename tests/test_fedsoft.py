"""FedSoft (Ruan & Joe-Wong, 2022) and IFCA: importances, eq. (6), selection, eq. (4), and a run."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from flwr.app import ArrayRecord, RecordDict
from torch import nn

from ondevice_moe import runner
from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.methods.base import MethodContext
from ondevice_moe.methods.fedsoft import procedure as centres_side
from ondevice_moe.methods.fedsoft.centres import (
    ProximalAnchors,
    centre_key,
    hard_assignment,
    importance_weights,
    split_centres,
)
from ondevice_moe.methods.fedsoft.config import FedSoftOptions
from ondevice_moe.methods.fedsoft.method import fedsoft, ifca
from ondevice_moe.methods.fedsoft.rule import CentreRule, aggregation_weights, select_clients
from ondevice_moe.recipe import load_recipe, validate_recipe
from ondevice_moe.server_rules.aggregation import Update

TINY_FEDSOFT = Path(__file__).parent / "recipes" / "tiny-fedsoft.yaml"


def _update(device: int, value: float, examples: int, mixture: tuple[float, ...]) -> Update:
    return Update(device, {"w": torch.tensor([value])}, examples, {"mixture": {"pi": list(mixture)}})


# -- importance (Alg. 1 lines 5-10) ------------------------------------------------------------------------------


def test_importance_counts_each_example_at_its_lowest_loss_centre():
    losses = torch.tensor([[1.0, 5.0, 0.2, 3.0, 9.0],
                           [2.0, 1.0, 0.9, 1.0, 0.1]])  # example-wise winners: 0, 1, 0, 1, 1
    assert importance_weights(losses, 1e-4) == pytest.approx([2 / 5, 3 / 5])


def test_a_centre_that_wins_no_example_gets_the_floor_sigma():
    losses = torch.tensor([[1.0, 1.0], [0.5, 0.2], [4.0, 4.0]])
    assert importance_weights(losses, 1e-4) == pytest.approx([1e-4, 1.0, 1e-4])


def test_ifca_picks_the_centre_with_the_lowest_total_loss():
    losses = torch.tensor([[0.0, 0.0, 9.0], [1.0, 1.0, 1.0]])  # centre 0 wins two examples, but loses on the sum
    assert hard_assignment(losses) == 1


# -- eq. (6) and aggregation ---------------------------------------------------------------------------------------


def test_aggregation_weights_follow_eq_6():
    importance = np.array([[0.9, 0.1], [0.2, 0.8], [1e-4, 1.0]])
    examples = np.array([100.0, 200.0, 150.0])
    weights = aggregation_weights(importance, examples)
    first = np.array([90.0, 40.0, 0.015]) / 130.015
    second = np.array([10.0, 160.0, 150.0]) / 320.0
    np.testing.assert_allclose(weights, np.stack([first, second]))


def test_full_participation_makes_each_centre_the_v_weighted_mean():
    rule = CentreRule(clusters=2)
    updates = [_update(0, 1.0, 100, (0.9, 0.1)), _update(1, 5.0, 200, (0.2, 0.8))]
    slots = rule.aggregate(rule.initial_slots(), updates)
    assert slots["cluster_0"]["w"].item() == pytest.approx((90 * 1 + 40 * 5) / 130)
    assert slots["cluster_1"]["w"].item() == pytest.approx((10 * 1 + 160 * 5) / 170)


def test_ifca_averages_each_centre_over_the_clients_that_chose_it_and_keeps_the_unchosen():
    rule = CentreRule(clusters=3)
    slots = {**rule.initial_slots(), "cluster_2": {"w": torch.tensor([7.0])}}
    updates = [_update(0, 1.0, 100, (1.0, 0.0, 0.0)), _update(1, 4.0, 300, (1.0, 0.0, 0.0)),
               _update(2, 2.0, 50, (0.0, 1.0, 0.0))]
    slots = rule.aggregate(slots, updates)
    assert slots["cluster_0"]["w"].item() == pytest.approx((100 * 1 + 300 * 4) / 400)
    assert slots["cluster_1"]["w"].item() == pytest.approx(2.0)
    assert slots["cluster_2"]["w"].item() == pytest.approx(7.0)


def test_an_update_without_weights_over_every_centre_counts_towards_none():
    rule = CentreRule(clusters=2)
    sound = _update(0, 1.0, 100, (0.5, 0.5))
    malformed = [_update(1, 9.0, 100, ()), _update(2, 9.0, 100, (1.0,)), _update(3, 9.0, 100, (float("nan"), 1.0)),
                 _update(4, 9.0, 100, (-1.0, 2.0))]
    slots = rule.aggregate(rule.initial_slots(), [sound, *malformed])
    assert slots["cluster_0"]["w"].item() == 1.0 and slots["cluster_1"]["w"].item() == 1.0


def test_a_selected_centre_is_the_plain_mean_of_k_clients_and_the_draw_follows_the_seed():
    updates = [_update(k, float(10 ** k), 100, (0.5, 0.5)) for k in range(4)]
    rule = CentreRule(clusters=2, selection_size=2, seed=3)
    first = rule.aggregate(rule.initial_slots(), updates)
    pair_means = {(10 ** i + 10 ** j) / 2 for i, j in itertools.combinations(range(4), 2)}
    assert first["cluster_0"]["w"].item() in pair_means  # a mean of two distinct clients, weights 1/K
    assert rule.aggregate(rule.initial_slots(), updates)["cluster_0"]["w"].item() == first["cluster_0"]["w"].item()
    later = [rule.aggregate(first, updates)["cluster_0"]["w"].item() for _ in range(2)]
    assert later[0] == later[1]  # the next round draws from (seed, round, centre): reproducible too
    others = {CentreRule(clusters=2, selection_size=2, seed=s).aggregate(rule.initial_slots(), updates)
              ["cluster_0"]["w"].item() for s in range(20)}
    assert len(others) > 1, "other seeds draw other clients"


def test_with_selected_train_only_the_drawn_clients_train_and_each_centre_is_their_plain_mean():
    """Alg. 1 lines 16-18: after round 1 (everyone trains, the server hears every u_k and n_k), the
    server draws Sel_s per centre from what it heard and asks only their union; centre s is the plain
    mean of Sel_s's models. Clients 0-1 lean on centre 0, 2-3 on centre 1, so with K = 1 each centre
    draws one client of its own group."""
    leaning = [(0.999, 0.001), (0.999, 0.001), (0.001, 0.999), (0.001, 0.999)]
    updates = [_update(k, float(10 ** k), 100, leaning[k]) for k in range(4)]
    rule = CentreRule(clusters=2, selection_size=1, seed=3, selected_train=True)
    assert rule.devices_to_train(rule.initial_slots(), [0, 1, 2, 3]) == [0, 1, 2, 3]  # nobody heard yet
    after_first = rule.aggregate(rule.initial_slots(), updates)
    rounds = []
    slots = after_first
    for _ in range(12):
        training = rule.devices_to_train(slots, [0, 1, 2, 3])
        assert len(training) == 2 and len({d // 2 for d in training}) == 2, training  # one of each group
        assert rule.devices_to_train(slots, [0, 1, 2, 3]) == training  # the draw follows (seed, round)
        arrived = [updates[d] for d in training]
        slots = rule.aggregate(slots, arrived)
        centre_0, centre_1 = slots["cluster_0"]["w"].item(), slots["cluster_1"]["w"].item()
        assert {centre_0, centre_1} == {updates[d].tensors["w"].item() for d in training}  # each its one client
        rounds.append(tuple(training))
    assert len(set(rounds)) > 1, "other rounds draw other clients"
    late = rule.devices_to_train({**after_first, "importances": {"0": after_first["importances"]["0"]}}, [0, 1, 2])
    assert {1, 2} <= set(late), "a client the server has not heard from trains and reports"
    plain = CentreRule(clusters=2, selection_size=1, seed=3)
    assert plain.devices_to_train(after_first, [0, 1, 2, 3]) == [0, 1, 2, 3]
    assert "importances" not in plain.aggregate(plain.initial_slots(), updates)


def _inclusion_probabilities(weights: np.ndarray, count: int) -> np.ndarray:
    """Exact probability that each client is among ``count`` drawn in turn without replacement."""
    total = np.zeros(len(weights))
    for order in itertools.permutations(range(len(weights)), count):
        probability, left = 1.0, 1.0
        for client in order:
            probability *= weights[client] / left
            left -= weights[client]
        total[list(order)] += probability
    return total


@pytest.mark.parametrize("count", [1, 2])
def test_selection_frequencies_match_the_drawing_probabilities(count):
    """K = 1: each client is drawn with probability v_sk (Alg. 1 line 16); K = 2: with the
    inclusion probability of drawing in turn without replacement (the authors' numpy choice)."""
    weights = np.array([0.5, 0.3, 0.15, 0.05])
    draws = 20_000
    frequencies = np.zeros(len(weights))
    for seed in range(draws):
        frequencies[select_clients(weights, count, np.random.default_rng(seed))] += 1
    expected = weights if count == 1 else _inclusion_probabilities(weights, count)
    np.testing.assert_allclose(frequencies / draws, expected, atol=0.012)


def test_selection_takes_every_weighted_client_when_fewer_than_k_have_weight():
    chosen = select_clients(np.array([0.0, 0.7, 0.0, 0.3]), 3, np.random.default_rng(0))
    assert chosen.tolist() == [1, 3]


# -- eq. (4) and (5) -----------------------------------------------------------------------------------------------


def test_the_proximal_gradient_is_lambda_times_w_minus_the_weighted_centres():
    generator = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(3, 4, generator=generator))
    centres = tuple({"net.weight": torch.randn(3, 4, generator=generator)} for _ in range(3))
    weights, strength = (0.6, 0.3, 0.1), 0.7
    penalty = ProximalAnchors(centres, weights, strength).penalty([("net.weight", w)])
    pairs = list(zip(weights, (c["net.weight"] for c in centres), strict=True))
    expected_value = 0.5 * strength * sum(u * (w - c).pow(2).sum() for u, c in pairs)
    assert penalty.item() == pytest.approx(expected_value.item())
    penalty.backward()
    expected = strength * (sum(weights) * w.detach() - sum(u * c for u, c in pairs))  # eq. (5) when Σ u = 1
    torch.testing.assert_close(w.grad, expected)


def test_no_proximal_term_at_lambda_zero():
    assert ProximalAnchors(({"w": torch.zeros(1)},), (1.0,), 0.0).penalty([("w", nn.Parameter(torch.ones(1)))]) \
        is None


def test_centres_travel_under_their_slot_and_split_back():
    sent = {centre_key(s, "net.1.weight"): torch.full((1, 2), float(s)) for s in range(3)}
    centres = split_centres(sent)
    assert sorted(centres) == [0, 1, 2] and centres[2]["net.1.weight"][0, 0].item() == 2.0


# -- the device ----------------------------------------------------------------------------------------------------


def test_the_device_anchors_its_own_model_and_sends_its_importances():
    job = Job(load_recipe(TINY_FEDSOFT), 0, Path("."))
    state = RecordDict()
    trainer = dev.restore_trainer(job, 0, None, state)
    own = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
    chosen = job.method.procedure.begin_round(dev.JobDevice(job, 0, state), trainer, None, 1)
    assert [name for name in chosen] == ["importance_0", "importance_1"]
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(tensor, own[name])  # the centres are read, not loaded
    anchors = trainer.round_state[centres_side.ANCHORS]
    assert anchors.strength == 1.0 and len(anchors.centres) == 2
    centres = centres_side.received_centres(dev.JobDevice(job, 0), None)
    assert not torch.equal(centres[0]["net.1.weight"], centres[1]["net.1.weight"]), "seeded independently"
    _, records = dev.upload(job, trainer)
    assert records["mixture"]["pi"] == pytest.approx([chosen["importance_0"], chosen["importance_1"]])


def test_importances_are_kept_between_estimations():
    job = Job(load_recipe(TINY_FEDSOFT), 0, Path("."))
    state = RecordDict()
    trainer = dev.restore_trainer(job, 0, None, state)
    job.method.procedure.begin_round(dev.JobDevice(job, 0, state), trainer, None, 1)
    state["importance"]["u"] = [0.25, 0.75]
    kept = job.method.procedure.begin_round(dev.JobDevice(job, 0, state), trainer, None, 2)  # τ = 2: no estimate
    assert kept == {"importance_0": 0.25, "importance_1": 0.75}
    fresh = job.method.procedure.begin_round(dev.JobDevice(job, 0, state), trainer, None, 3)
    assert fresh != kept


def test_an_ifca_device_trains_its_lowest_loss_centre_and_sends_the_choice():
    job = Job(load_recipe(TINY_FEDSOFT), 1, Path("."))
    assert job.method.name == "ifca"
    state = RecordDict()
    trainer = dev.restore_trainer(job, 0, None, state)
    near, far = torch.zeros(1, 10), torch.full((1, 10), 100.0)  # a zero map beats one far off on every example
    sent = ArrayRecord({centre_key(0, "net.1.weight"): far, centre_key(1, "net.1.weight"): near})
    received = sent.to_torch_state_dict()
    assert job.method.procedure.begin_round(dev.JobDevice(job, 0, state), trainer, received, 1) == {"centre": 1}
    torch.testing.assert_close(trainer.model.state_dict()["net.1.weight"], near)
    assert trainer.round_state[centres_side.ANCHORS].penalty(trainer.trainable) is None, "IFCA has no proximal term"
    assert dev.upload(job, trainer)[1]["mixture"]["pi"] == [0.0, 1.0]
    evaluated = dev.restore_trainer(job, 0, None, state).model
    centres = centres_side.received_centres(dev.JobDevice(job, 0), received)
    centres_side.local_model_of(job.method.procedure, dev.JobDevice(job, 0, state), evaluated, centres)
    torch.testing.assert_close(evaluated.state_dict()["net.1.weight"], near)


def test_a_local_model_is_also_scored_on_its_own_training_data_as_fedsoft_section_5_does():
    from ondevice_moe.federation.evaluation import prepare_test

    job = Job(load_recipe(TINY_FEDSOFT), 1, Path("."))  # IFCA: the local model is the centre of lowest loss
    state = RecordDict()
    zero, far = torch.zeros(1, 10), torch.full((1, 10), 100.0)  # the zero map wins: a model predicting 0
    received = ArrayRecord({centre_key(0, "net.1.weight"): far, centre_key(1, "net.1.weight"): zero}
                           ).to_torch_state_dict()
    model = dev.restore_trainer(job, 0, None, state).model
    scores = prepare_test(job, 0, model, received, state)
    task = dev.federated_task(job)
    train_targets, test_targets = task.train[0].labels, task.test[0].labels
    assert scores["user_0/score_train"] == pytest.approx(float((train_targets ** 2).mean()), rel=1e-5)
    assert scores["user_0/score_train"] != pytest.approx(float((test_targets ** 2).mean()), rel=1e-3)


# -- the rotated-digits mixture ------------------------------------------------------------------------------------


def test_rotated_digit_mixtures_turn_each_clients_share_of_its_images():
    from ondevice_moe.data.small import _digits, build_small_task, mixture_counts

    task = build_small_task("digits-rotate-10-90", clients=4, seed=0)
    upright = {image.tobytes() for image in _digits()[0].astype(np.float32)}
    for shares, examples in zip(task.mixtures, task.train, strict=True):
        images = examples.inputs[:, 0].numpy()
        turned_back = np.rot90(images, k=-1, axes=(1, 2))
        found = [image.tobytes() in upright for image in images]
        found_turned = [image.tobytes() in upright for image in np.ascontiguousarray(turned_back)]
        first, _ = mixture_counts(shares, len(images))
        assert all(found[:first]) and not any(found[first:]), shares
        assert all(found_turned[first:]), shares
    assert task.mixtures[0].tolist() == [0.1, 0.9] and task.mixtures[-1].tolist() == [0.9, 0.1]
    torch.testing.assert_close(task.cluster_test[1].inputs, torch.rot90(task.cluster_test[0].inputs, 1, (2, 3)))


# -- bad input -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "context", "fix"), [
    ({"clusters": 4}, MethodContext(3, clusters=2), "at most 3 centres"),
    ({"selection_size": 5}, MethodContext(3, clusters=2), "at most 3"),
    ({}, MethodContext(3), "set `clusters`"),
])
def test_impossible_centres_or_selection_say_how_to_fix_them(options, context, fix):
    for build in (fedsoft, ifca):
        if "selection_size" in options and build is ifca:
            continue
        with pytest.raises(UserError) as error:
            build(FedSoftOptions(**options), context)
        assert fix in error.value.fix


def test_the_linear_model_has_no_intercept_and_only_small_models_drop_their_bias():
    job = Job(load_recipe(TINY_FEDSOFT), 0, Path("."))
    assert [name for name, _ in dev.build_model(job, 0).named_parameters()] == ["net.1.weight"]
    assert list(centres_side.received_centres(dev.JobDevice(job, 0), None)[1]) == ["net.1.weight"]
    raw = yaml.safe_load(TINY_FEDSOFT.read_text())
    raw["model"], raw["task"], raw["methods"] = {"name": "tiny-bert", "bias": False}, {"name": "sst2"}, ["fed-ft"]
    with pytest.raises(UserError, match="small models"):
        validate_recipe(raw)


def test_fedsoft_on_a_hugging_face_model_needs_cluster_adapters():
    raw = yaml.safe_load(TINY_FEDSOFT.read_text())
    raw["model"], raw["task"] = {"name": "tiny-bert"}, {"name": "sst2", "clients": 2}
    raw["fedsoft"].update(clusters=2, selection_size=None)
    with pytest.raises(UserError, match=r"fedsoft\.lora_rank"):
        validate_recipe(raw)
    raw["fedsoft"] = {**raw.get("fedsoft", {}), "lora_rank": 4}
    assert validate_recipe(raw).method(0).layouts[0].attention_lora == "shared"



def test_scoring_the_centres_on_validation_blocks_needs_a_language_modelling_recipe():
    raw = yaml.safe_load(TINY_FEDSOFT.read_text())
    raw["fedsoft"] = {**raw.get("fedsoft", {}), "importance_split": "valid"}
    with pytest.raises(UserError, match=r"importance_split: train"):
        validate_recipe(raw)


# -- a run ---------------------------------------------------------------------------------------------------------


def test_a_selected_train_run_trains_only_the_drawn_clients_after_round_one(tmp_path):
    recipe = load_recipe(TINY_FEDSOFT, ["methods=[fedsoft]", "fedsoft.selection_size=1",
                                        "fedsoft.selected_train=true", "federation.rounds=4"])
    runner.run_recipe(recipe, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = {r["round"]: {r["user"] for r in records if r.get("kind") == "train" and r["round"] == r2}
               for r2 in range(1, 5) for r in records if r.get("round") == r2}
    assert len(trained[1]) == 6  # nobody heard from yet: every client trains and reports
    assert all(1 <= len(trained[t]) <= 2 for t in (2, 3, 4)), trained  # two centres, K = 1 each
    sent = {r["round"]: r["bytes_down"] for r in records if r.get("kind") == "comm"}
    assert len({sent[t] / len(trained[t]) for t in (2, 3, 4)}) == 1, "one message per client drawn, none to others"
    with pytest.raises(UserError, match="selection_size"):
        Job(load_recipe(TINY_FEDSOFT, ["methods=[fedsoft]", "fedsoft.selection_size=null",
                                       "fedsoft.selected_train=true"]), 0, Path("."))


@pytest.mark.parametrize("method", ["fedsoft", "fedem"])
def test_two_centres_separate_on_a_10_90_mixture_of_two_sources(tmp_path, method):
    """Six clients, two synthetic regression sources mixed 10:90 and 90:10 (FedSoft §5): matched
    to sources by the best assignment, each centre has a lower MSE on its own source than on the
    other (the diagonal of Table 1), and each client's larger importance (FedEM: its π) sits on
    the centre of its majority source. FedEM's mixture prediction is scored for every client."""
    raw = yaml.safe_load(TINY_FEDSOFT.read_text())
    raw["methods"] = [method]
    result = runner.run_recipe(validate_recipe(raw), tmp_path / "run")
    centres = result.summary["methods"][method]["centres"]
    mse = np.array([[centres[f"centre_{c}_source_{s}"] for s in range(2)] for c in range(2)])
    match = min(itertools.permutations(range(2)), key=lambda order: sum(mse[c, s] for c, s in enumerate(order)))
    for centre, source in enumerate(match):
        assert mse[centre, source] < mse[centre, 1 - source], (mse, match)
    final = {}
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            final[record["user"]] = (record["importance_0"], record["importance_1"])
    for client, weights in final.items():
        majority = 1 if int(client.removeprefix("client_")) < 3 else 0  # clients 0-2 hold 10 % of source 0
        assert match[int(np.argmax(weights))] == majority, (final, match)
    local = result.summary["methods"][method]
    assert set(local["per_user"]["client_0"]) >= {"score", "score_train"} and local["mean_score_train"] > 0
    assert "training data (w̄)" in (tmp_path / "run" / "report.md").read_text()
    if method == "fedem":  # its own prediction, the π-mixture of the centres, scored beside its centre of largest π
        mixture = result.summary["methods"]["fedem-mixture"]["per_user"]
        assert set(mixture) == set(final) and mixture != result.summary["methods"]["fedem"]["per_user"]
