"""A classifier's validation split (issue 33's fair baselines on classification tasks): held out of the
training split, dealt as the test split is, scored with ``task.eval_split: valid``, and chosen on by
``eval/lr_sweep.py``, so a learning rate is never chosen on the test split."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from ondevice_moe import runner
from ondevice_moe.data.classification import build_federated_task
from ondevice_moe.data.small import _digits, build_small_task
from ondevice_moe.data.tasks import (
    UserTaskFile,
    load_client_tasks,
    load_client_train_and_valid,
    load_task,
    load_train_and_valid,
    user_task,
)
from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.models.tiny import byte_tokenizer
from ondevice_moe.recipe import load_recipe

TESTS = Path(__file__).parent / "recipes"
CLASSIFICATION = TESTS / "tiny-classification.yaml"
FLOW = TESTS / "tiny-flow.yaml"
sys.path.insert(0, str(Path(__file__).parents[1] / "eval"))


def _movies(tmp_path: Path, count: int = 100) -> object:
    path = tmp_path / "movies.csv"
    pd.DataFrame({"review": [f"film {i}" for i in range(count)],
                  "verdict": ["good" if i % 2 else "bad" for i in range(count)]}).to_csv(path, index=False)
    return user_task("movies", ["bad", "good"], UserTaskFile(path, ("review",), "verdict"))


# -- the split itself -----------------------------------------------------------------------------------


def test_under_a_training_cap_validation_comes_from_the_rows_it_leaves_and_training_is_unchanged(tmp_path):
    task = _movies(tmp_path)
    train, valid = load_train_and_valid(task, 30, 20, seed=3)
    assert train == load_task(task, "train", 30, seed=3)  # the same 30 training rows as without a validation split
    whole = set(load_task(task, "train").texts)
    assert len(valid.labels) == 20 and set(valid.texts) <= whole
    assert not set(valid.texts) & set(train.texts)
    assert not set(valid.texts) & set(load_task(task, "test").texts)
    assert load_train_and_valid(task, 30, 20, seed=3) == (train, valid)  # seeded
    assert load_train_and_valid(task, 30, 20, seed=4)[1] != valid


def test_without_a_cap_validation_comes_out_of_training(tmp_path):
    task = _movies(tmp_path)
    train, valid = load_train_and_valid(task, None, 20, seed=0)
    whole = load_task(task, "train")
    assert (len(train.labels), len(valid.labels)) == (60, 20)
    assert sorted(train.texts + valid.texts) == sorted(whole.texts)


def test_a_validation_split_that_does_not_fit_is_one_message(tmp_path):
    task = _movies(tmp_path)
    with pytest.raises(UserError, match=r"80 training rows: 70 for training leave 10 for the 20 validation") as error:
        load_train_and_valid(task, 70, 20)
    assert "lower task.valid_examples or task.max_train_examples" in error.value.fix
    with pytest.raises(UserError, match="too few to hold 80 out"):
        load_train_and_valid(task, None, 80)


def test_each_client_file_holds_its_own_validation_rows_out(tmp_path):
    files = []
    for client, count in enumerate((20, 30)):
        pd.DataFrame({"review": [f"client {client} row {i}" for i in range(count)],
                      "verdict": ["good" if i % 2 else "bad" for i in range(count)]}).to_csv(
            tmp_path / f"c{client}.csv", index=False)
        files.append(tmp_path / f"c{client}.csv")
    task = user_task("movies", ["bad", "good"], UserTaskFile(tmp_path, ("review",), "verdict", tuple(files)))
    held = load_client_train_and_valid(task, None, 4, seed=0)
    for client, (train, valid) in enumerate(held):
        whole = load_client_tasks(task, "train")[client]
        assert len(valid.labels) == 4 and sorted(train.texts + valid.texts) == sorted(whole.texts)
        assert all(text.startswith(f"client {client} ") for (text,) in valid.texts)
    federated = build_federated_task(task, 2, 1.0, byte_tokenizer(), 16, seed=0, valid_examples=4)
    assert [len(v) for v in federated.valid] == [4, 4] and [len(t) for t in federated.train] == [12, 20]


def test_dirichlet_clients_get_validation_examples_with_their_own_label_skew(tmp_path):
    task = _movies(tmp_path, 400)
    plain = build_federated_task(task, 4, 0.5, byte_tokenizer(), 16, seed=1, max_train_examples=120)
    held = build_federated_task(task, 4, 0.5, byte_tokenizer(), 16, seed=1, max_train_examples=120,
                                valid_examples=120)
    assert plain.valid is None
    for before, after in zip(plain.train + plain.test, held.train + held.test, strict=True):
        assert torch.equal(before.input_ids, after.input_ids) and torch.equal(before.labels, after.labels)
    train_share = [float(c.labels.float().mean()) for c in held.train]
    valid_share = [float(c.labels.float().mean()) for c in held.valid]
    assert sum(map(len, held.valid)) == 120
    assert np.corrcoef(train_share, valid_share)[0, 1] > 0.8  # the same proportions deal both splits


def test_digits_hold_validation_images_out_of_training_and_deal_them_like_the_test_images():
    plain = build_small_task("digits-dirichlet", 6, seed=0, alpha=0.3)
    held = build_small_task("digits-dirichlet", 6, seed=0, alpha=0.3, valid_examples=288)
    assert sum(map(len, held.valid)) == 288 and plain.valid is None
    assert sum(map(len, held.train)) == sum(map(len, plain.train)) - 288
    for before, after in zip(plain.test, held.test, strict=True):
        assert torch.equal(before.inputs, after.inputs)
    train_rows = {tuple(x.flatten().tolist()) for c in held.train for x in c.inputs}
    assert not any(tuple(x.flatten().tolist()) in train_rows for c in held.valid for x in c.inputs)
    for train, valid in zip(held.train, held.valid, strict=True):  # label skew: the client's main labels
        assert Counter(valid.labels.tolist()).most_common(1)[0][0] in set(train.labels.tolist())
    rotated = build_small_task("digits-rotate", 8, seed=0, valid_examples=100)
    assert sum(map(len, rotated.valid)) == 100
    upright = {tuple(np.round(image, 6).flatten()) for image in _digits()[0]}
    for client, examples in enumerate(rotated.valid):  # client k's cluster turns its images by 90° · (k mod 4)
        turned_back = np.rot90(examples.inputs[:, 0].numpy(), k=-(client % 4), axes=(1, 2))
        assert all(tuple(np.round(image, 6).flatten()) in upright for image in turned_back)


def test_the_synthetic_tasks_refuse_a_validation_split():
    with pytest.raises(UserError, match="generating model and holds no validation split") as error:
        build_small_task("floral-linear", valid_examples=10)
    assert "data_seed" in error.value.fix
    with pytest.raises(UserError, match="train on 1438 images"):
        build_small_task("digits-dirichlet", 4, valid_examples=1438)


# -- the recipe and the run ---------------------------------------------------------------------------


def test_eval_split_valid_needs_valid_examples():
    with pytest.raises(UserError, match=r"task\.eval_split: valid scores each client's validation split") as error:
        load_recipe(CLASSIFICATION, ["task.eval_split=valid"])
    assert "task.valid_examples" in str(error.value)
    with pytest.raises(UserError, match="holds no validation split"):
        load_recipe(TESTS / "tiny-floral.yaml", ["task.valid_examples=10"])


def test_a_client_is_scored_on_its_validation_examples_under_eval_split_valid():
    test_job = Job(load_recipe(CLASSIFICATION, ["task.valid_examples=60"]), 0, Path("."))
    valid_job = Job(load_recipe(CLASSIFICATION, ["task.valid_examples=60", "task.eval_split=valid"]), 0, Path("."))
    task = dev.federated_task(valid_job)
    for client in range(3):
        assert dev.scored_examples(valid_job, client) is task.valid[client]
        assert dev.scored_examples(test_job, client) is dev.federated_task(test_job).test[client]
        assert not torch.equal(task.valid[client].input_ids[:5], task.test[client].input_ids[:5])


@pytest.fixture(scope="module")
def flow_runs(runs_on_each_split):
    """Flow on digits for one round, scored on each split: the same training, two splits."""
    return runs_on_each_split(FLOW, "task.eval_split", ["task.valid_examples=240", "federation.rounds=1",
                                                        "federation.eval_every=1"])


def test_a_classifiers_validation_run_says_so_and_rescores_on_test_from_the_same_models(flow_runs):
    valid, test = flow_runs["valid"], flow_runs["test"]
    assert valid.summary["eval_split"] == "valid" and test.summary["eval_split"] == "test"
    ours, theirs = valid.summary["methods"]["flow"], test.summary["methods"]["flow"]
    assert ours["mean_score"] != theirs["mean_score"]
    report = valid.report.read_text(encoding="utf-8")
    assert "VALIDATION accuracy ×100 (task.eval_split: valid)" in report
    assert "Each client on its own validation split" in report
    assert "VALIDATION" not in test.report.read_text(encoding="utf-8")
    rescored = runner.evaluate_run(valid.run_dir, split="test")
    assert rescored["eval_split"] == "test"
    assert rescored["methods"]["flow"]["mean_score"] == pytest.approx(theirs["mean_score"])


def test_split_valid_on_a_run_without_a_validation_split_is_one_message(tmp_path):
    recipe = load_recipe(FLOW, ["federation.rounds=1", "methods=[fed-ft]"])
    run = runner.run_recipe(recipe, tmp_path / "run")
    with pytest.raises(UserError, match="holds none") as error:
        runner.evaluate_run(run.run_dir, split="valid")
    assert "--split test" in error.value.fix


# -- eval/lr_sweep.py on a task ------------------------------------------------------------------------


def _scores(metric: str, values: dict[str, float]) -> dict:
    return {"users": ["a"], "metric": metric, "eval_split": "valid",
            "methods": {m: {"mean_score": v, "std_score": 0.0, "upload_bytes_per_round": 0,
                            "per_user": {"a": {"score": v}}} for m, v in values.items()}}


def test_sweep_table_picks_the_highest_accuracy_and_the_lowest_error():
    import lr_sweep

    accuracy = {1e-4: _scores("accuracy", {"a": 80.0, "b": 90.0}), 1e-3: _scores("accuracy", {"a": 85.0, "b": 70.0})}
    table, best = lr_sweep.sweep_table(accuracy, "in")
    assert best == {"a": 1e-3, "b": 1e-4}
    assert "valid accuracy" in table and "| a | 80.00 | 85.00 | 0.001 (edge of the grid) |" in table
    error = {1e-4: _scores("mse", {"a": 3.0}), 1e-3: _scores("mse", {"a": 2.0}), 1e-2: _scores("mse", {"a": 4.0})}
    assert lr_sweep.sweep_table(error, "in")[1] == {"a": 1e-3}
    with pytest.raises(SystemExit, match="a task has one score"):
        lr_sweep.sweep_table(accuracy, "out")


def test_lr_sweep_refuses_a_classification_recipe_without_a_validation_split(tmp_path):
    import lr_sweep

    with pytest.raises(SystemExit, match=r"task\.valid_examples=N"):
        lr_sweep.main([str(FLOW), "--rates", "0.1", "--out", str(tmp_path), "--dry-run"])
    with pytest.raises(SystemExit, match=r"task\.eval_split"):
        lr_sweep.main([str(FLOW), "--rates", "0.1", "--set", "task.eval_split=valid", "--dry-run"])


@pytest.mark.slow
def test_lr_sweep_on_digits_chooses_on_the_validation_split_and_tests_the_choice(tmp_path, capsys, monkeypatch):
    import lr_sweep

    monkeypatch.chdir(Path(__file__).parents[1])
    out = tmp_path / "sweep"
    sets = ["--set", "federation.rounds=2", "--set", "federation.eval_every=2", "--set", "task.valid_examples=240",
            "--set", "methods=[fed-ft, flow]"]
    lr_sweep.main([str(FLOW), "--rates", "1e-4", "0.1", "--out", str(out), *sets, "--test-seeds", "0",
                   "--against", "fed-ft"])  # seed 0 re-scored from the sweep's checkpoints (a new seed: the LM test)
    printed = capsys.readouterr().out
    valid = {rate: json.loads((out / f"valid-lr{rate:g}-s0" / "summary.json").read_text()) for rate in (1e-4, 0.1)}
    assert all(summary["eval_split"] == "valid" for summary in valid.values())
    best = json.loads((out / "best_rates.json").read_text())
    for method, rate in best.items():  # each method's highest validation accuracy
        assert valid[rate]["methods"][method]["mean_score"] == max(
            summary["methods"][method]["mean_score"] for summary in valid.values())
        summary = json.loads((out / f"test-lr{rate:g}-s0" / "summary.json").read_text())
        assert summary["eval_split"] == "test" and method in summary["methods"]
    assert "Validation accuracy (task.eval_split: valid)" in printed and "Test accuracy" in printed
