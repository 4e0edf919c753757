"""Classification tasks and Dirichlet label-skew partitions (their metrics: tests/test_metrics.py)."""

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from ondevice_moe.data.classification import build_federated_task
from ondevice_moe.data.partition import dirichlet_partition, dirichlet_proportions, label_bins, partition_by_proportions
from ondevice_moe.data.small import SMALL_TASKS
from ondevice_moe.data.tasks import (
    SPLITS,
    TASKS,
    LabelledExamples,
    UserTaskFile,
    check_labels,
    fixed_split,
    get_task,
    load_client_tasks,
    load_task,
    user_task,
)
from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.metrics import METRICS
from ondevice_moe.models.tiny import byte_tokenizer
from ondevice_moe.recipe import TaskSection, load_recipe, validate_recipe

# ---------------------------------------------------------------- tasks


TEXT_TASKS = {"sst2", "mrpc", "cola", "rte", "qnli", "stsb", "mnli", "qqp", "rotten-tomatoes", "bbc-news"}


def test_registry_is_consistent():
    assert {name for name, task in TASKS.items() if task.is_text} == TEXT_TASKS
    assert set(SMALL_TASKS) == set(TASKS) - TEXT_TASKS
    for name, task in TASKS.items():
        assert task.name == name
        assert task.metric in METRICS
        assert len(task.label_names) == task.num_labels
        assert task.metric == "mse" if task.is_regression and not task.is_text else task.metric != "mse"
    assert (TASKS["mrpc"].metric, TASKS["cola"].metric, TASKS["stsb"].metric) == ("f1", "mcc", "spearman")
    assert TASKS["stsb"].is_regression and not TASKS["mnli"].is_regression
    assert [(TASKS[n].clients, TASKS[n].clusters) for n in ("floral-linear", "floral-mlp")] == [(10, 2), (20, 4)]
    assert TASKS["floral-linear"].is_regression and TASKS["digits-rotate"].metric == "accuracy"


def test_small_tasks_are_not_loaded_as_text():
    with pytest.raises(UserError, match="not a text task"):
        load_task("digits-rotate", "train")


@pytest.mark.parametrize(("name", "num_labels"), [("rotten-tomatoes", 2), ("bbc-news", 5)])
def test_offline_tasks_load_disjoint_deterministic_splits(name, num_labels):
    train, test = load_task(name, "train"), load_task(name, "test")
    for split in (train, test):
        assert len(split.texts) == len(split.labels)
        assert set(split.labels) == set(map(float, range(num_labels)))
        assert all(len(texts) == 1 and texts[0].strip() for texts in split.texts)
    assert not set(train.texts) & set(test.texts)
    assert len(set(train.texts)) == len(train.texts)
    assert len(test.texts) == pytest.approx(0.25 * len(train.texts), rel=0.01)
    assert load_task(name, "test").texts == test.texts


def test_rotten_tomatoes_labels_and_no_plot_rows():
    assert TASKS["rotten-tomatoes"].label_names == ("rotten", "fresh")
    train = load_task("rotten-tomatoes", "train")
    counts = Counter(train.labels)
    assert counts[1.0] > counts[0.0] > 0  # the corpus has more fresh than rotten reviews
    assert len(train.labels) + len(load_task("rotten-tomatoes", "test").labels) < 12808  # 12808 fresh + rotten rows


def test_max_examples_takes_a_seeded_subset():
    full = load_task("bbc-news", "train")
    subset = load_task("bbc-news", "train", max_examples=50, seed=3)
    assert len(subset.labels) == 50
    assert set(subset.texts) <= set(full.texts)
    assert subset == load_task("bbc-news", "train", max_examples=50, seed=3)
    assert subset.texts != load_task("bbc-news", "train", max_examples=50, seed=4).texts
    assert len(set(subset.labels)) == 5
    assert load_task("bbc-news", "train", max_examples=10**6) == full


def test_glue_task_offline_raises_user_error():
    with pytest.raises(UserError, match="sst2") as error:
        load_task("sst2", "test")
    assert "rotten-tomatoes" in str(error.value)


def test_glue_fields_and_validation_split(monkeypatch):
    calls = []

    def fake_load_dataset(path, config, split):
        calls.append((path, config, split))
        return datasets.Dataset.from_dict(
            {"premise": ["a", "b"], "hypothesis": ["c", "d"], "label": [2, 0], "idx": [0, 1]}
        )

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    examples = load_task("mnli", "test")
    assert calls == [("nyu-mll/glue", "mnli", "validation_matched")]
    assert examples == LabelledExamples([("a", "c"), ("b", "d")], [2.0, 0.0])


def test_unknown_task_and_split_raise_user_error():
    with pytest.raises(UserError, match="bbc-news"):
        get_task("imdb")
    with pytest.raises(UserError, match="valid"):
        load_task("bbc-news", "valid")


@pytest.mark.parametrize(
    ("name", "labels", "bad"),
    [
        ("sst2", [0, 1, 2], "2"),
        ("mnli", [0.0, 1.5], "1.5"),
        ("cola", [0, -1], "-1"),
        ("rte", [1, "yes"], "'yes'"),
        ("stsb", [4.2, math.nan], "nan"),
        ("stsb", [math.inf], "inf"),
    ],
)
def test_check_labels_names_the_bad_value(name, labels, bad):
    with pytest.raises(UserError, match=name) as error:
        check_labels(TASKS[name], labels)
    message = str(error.value)
    assert f"label {bad} at index {len(labels) - 1}" in message


def test_check_labels_accepts_valid_labels():
    check_labels(TASKS["mnli"], [0, 1.0, 2, np.int64(1)])
    check_labels(TASKS["stsb"], [0.0, 3.7, 5])


# ---------------------------------------------------------------- user-labelled files


def _write_csv(path, rows, header="review,verdict"):
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return path


def _movie_rows(count=20):
    return [f'"film {i}, {"great" if i % 2 else "dull"}",{"good" if i % 2 else "bad"}' for i in range(count)]


def _csv_task(path, labels=("bad", "good"), text_columns=("review",), label_column="verdict"):
    return user_task("movies", labels, UserTaskFile(path, text_columns, label_column))


def test_csv_task_maps_label_names_and_splits_80_20(tmp_path):
    task = _csv_task(_write_csv(tmp_path / "movies.csv", _movie_rows()))
    assert (task.num_labels, task.label_names, task.metric, task.is_text) == (2, ("bad", "good"), "accuracy", True)
    train, test = load_task(task, "train"), load_task(task, "test")
    assert (len(train.labels), len(test.labels)) == (16, 4)
    assert sorted(train.texts + test.texts) == sorted((f"film {i}, {'great' if i % 2 else 'dull'}",)
                                                      for i in range(20))
    for texts, label in zip(train.texts + test.texts, train.labels + test.labels, strict=True):
        assert label == (1.0 if "great" in texts[0] else 0.0)
    assert load_task(task, "test") == test
    order_train, order_test = fixed_split(20)
    assert train.texts[0] == (f"film {order_train[0]}, {'great' if order_train[0] % 2 else 'dull'}",)
    assert test.texts[-1][0].startswith(f"film {order_test[-1]},")
    assert len(load_task(task, "train", max_examples=5, seed=1).labels) == 5


def test_jsonl_task_with_text_pairs_and_label_indices(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"premise": f"p{i}", "hypothesis": f"h{i}", "label": i % 3, "id": i} for i in range(12)]
    path.write_text("\n".join(map(json.dumps, rows)) + "\n\n", encoding="utf-8")
    task = user_task("nli", ["entailment", "neutral", "contradiction"],
                     UserTaskFile(path, ("premise", "hypothesis"), "label"), metric="mcc")
    examples = load_task(task, "train")
    assert len(examples.texts) == 10 and all(len(texts) == 2 for texts in examples.texts)
    for (premise, hypothesis), label in zip(examples.texts, examples.labels, strict=True):
        index = int(premise[1:])
        assert hypothesis == f"h{index}" and label == index % 3


def test_user_task_feeds_the_federated_task_builder(tmp_path):
    task = _csv_task(_write_csv(tmp_path / "movies.csv", _movie_rows(60)))
    federated = build_federated_task(task, 2, 100.0, byte_tokenizer(), 32, seed=0)
    assert federated.task is task
    assert sum(map(len, federated.train)) == 48 and sum(map(len, federated.test)) == 12


@pytest.mark.parametrize(
    ("rows", "message"),
    [(["a,maybe"], r"row 13: the label 'maybe' in column 'verdict' is not a class of task 'movies'"),
     (["a,2"], r"row 13: the label '2' in column"),
     (["a,-1"], r"row 13: the label '-1' in column")],
)
def test_user_labels_that_do_not_match_the_task(tmp_path, rows, message):
    path = _write_csv(tmp_path / "movies.csv", _movie_rows(12) + rows)
    with pytest.raises(UserError, match=message) as error:
        load_task(_csv_task(path), "train")
    assert "movies.csv" in error.value.problem and "'verdict'" in error.value.problem
    assert "['bad', 'good']" in error.value.fix


def test_user_file_problems_raise_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_task(_csv_task(tmp_path / "missing.csv"), "train")
    with pytest.raises(UserError, match=r"no column \['text'\]; its columns are \['review', 'verdict'\]") as error:
        load_task(_csv_task(_write_csv(tmp_path / "a.csv", _movie_rows()), text_columns=("text",)), "train")
    assert "text_columns" in error.value.fix
    with pytest.raises(UserError, match=r"has 3 labelled rows") as error:
        load_task(_csv_task(_write_csv(tmp_path / "b.csv", _movie_rows(3))), "train")
    assert "at least 10" in error.value.fix
    with pytest.raises(UserError, match=r"c\.csv, row 12 has no label in column 'verdict'"):
        load_task(_csv_task(_write_csv(tmp_path / "c.csv", [*_movie_rows(11), "lonely"])), "train")
    jsonl = tmp_path / "d.jsonl"
    good_rows = '{"review": "ok", "verdict": "bad"}\n' * 10
    jsonl.write_text('{"review": "ok", "verdict": "good"}\n{"review": "ok"}\n' + good_rows, encoding="utf-8")
    with pytest.raises(UserError, match=r"d\.jsonl, row 2 has no label in column 'verdict'"):
        load_task(_csv_task(jsonl), "train")
    jsonl.write_text('{"review": "ok", "verdict": "good"}\nnot json\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"cannot read .*d\.jsonl as JSON"):
        load_task(_csv_task(jsonl), "train")
    with pytest.raises(UserError, match=r"found no \.csv or \.tsv or \.json or \.jsonl or \.parquet files or folder"):
        load_task(_csv_task(_write_csv(tmp_path / "e.txt", _movie_rows())), "train")
    with pytest.raises(UserError, match="two distinct label names"):
        _csv_task(tmp_path / "a.csv", labels=("good", "good"))


def test_task_section_reads_user_files_and_small_options(tmp_path):
    path = _write_csv(tmp_path / "movies.csv", _movie_rows())
    section = TaskSection(name="movies", path=str(path), text_columns=["review"], label_column="verdict",
                          labels=["bad", "good"], metric="f1")
    assert section.spec() == dataclasses.replace(_csv_task(path), metric="f1")
    assert TaskSection(name="floral-mlp").clients == 20 and TaskSection(name="sst2").clients == 8
    assert TaskSection(name="digits-rotate", clients=6, clusters=2, data_fraction=0.05).spec() is TASKS["digits-rotate"]
    for bad, message in [
        ({"name": "movies", "path": str(path)}, "needs `labels`"),
        ({"name": "sst2", "path": str(path), "labels": ["a", "b"]}, "registered task"),
        ({"name": "movies"}, "unknown task 'movies'"),
        ({"name": "sst2", "labels": ["a", "b"]}, "only apply to your own labelled data"),
        ({"name": "sst2", "data_fraction": 0.5}, "only applies to the small tasks"),
        ({"name": "sst2", "clusters": 3}, "use 2 to 2 clusters"),
        ({"name": "stsb", "clusters": 2}, "cannot shift the labels"),
        ({"name": "digits-rotate", "clusters": 5}, "1 to 4 clusters"),
        ({"name": "movies", "path": str(path), "labels": ["a"]}, "two distinct label names"),
    ]:
        with pytest.raises(ValueError, match=message):
            TaskSection(**bad)


# ---------------------------------------------------------------- user data through `datasets`


def _movie_frame(count: int = 20, verdict=lambda i: "good" if i % 2 else "bad") -> pd.DataFrame:
    return pd.DataFrame({"review": [f"film {i}, {verdict(i)}" for i in range(count)],
                         "verdict": [verdict(i) for i in range(count)]})


@pytest.mark.parametrize("kind", ["tsv", "jsonl", "json", "parquet", "parquet-indices", "saved", "folder"])
def test_every_labelled_format_loads_the_same_examples(tmp_path, kind):
    frame = _movie_frame()
    frame.to_csv(tmp_path / "movies.csv", index=False)
    expected = [load_task(_csv_task(tmp_path / "movies.csv"), split) for split in SPLITS]
    path = tmp_path / "other" / "movies"
    path.parent.mkdir()
    if kind == "tsv":
        frame.to_csv(path, sep="\t", index=False)
    elif kind in ("jsonl", "json"):
        frame.to_json(path, orient="records", lines=kind == "jsonl")
    elif kind == "parquet":
        frame.to_parquet(path)
    elif kind == "parquet-indices":  # class indices instead of names
        frame.assign(verdict=[("bad", "good").index(v) for v in frame.verdict]).to_parquet(path)
    elif kind == "saved":
        datasets.DatasetDict({"train": datasets.Dataset.from_pandas(frame)}).save_to_disk(str(path))
    else:  # a folder of CSV files, read as one data set in name order
        path.mkdir()
        frame[:7].to_csv(path / "part-0.csv", index=False)
        frame[7:].to_csv(path / "part-1.csv", index=False)
    if kind not in ("saved", "folder"):
        path = path.rename(path.with_suffix("." + kind.split("-")[0]))
    assert [load_task(_csv_task(path), split) for split in SPLITS] == expected


def _client_files(folder: Path, counts=(12, 15, 20)) -> list[str]:
    """One CSV per client, each text naming its client and row; client 2 holds only 'good' rows."""
    for client, count in enumerate(counts):
        verdicts = ["good" if client == 2 or i % 2 else "bad" for i in range(count)]
        pd.DataFrame({"review": [f"client {client} row {i}" for i in range(count)], "verdict": verdicts}).to_csv(
            folder / f"client-{client}.csv", index=False)
    return [f"client-{client}.csv" for client in range(len(counts))]


def _per_file_task(folder: Path, names: list[str]):
    return user_task("movies", ["bad", "good"],
                     UserTaskFile(folder, ("review",), "verdict", tuple(folder / name for name in names)))


def test_one_file_per_client_gives_client_k_exactly_file_k(tmp_path):
    counts = (12, 15, 20)
    task = _per_file_task(tmp_path, _client_files(tmp_path, counts))
    train, test = (load_client_tasks(task, split) for split in SPLITS)
    for client, count in enumerate(counts):
        texts = [text for (text,) in train[client].texts + test[client].texts]
        assert sorted(texts) == sorted(f"client {client} row {i}" for i in range(count))
        assert len(test[client].labels) == count - round(0.8 * count)
    assert set(train[2].labels + test[2].labels) == {1.0}  # one client may hold one class
    federated = build_federated_task(task, 3, 1.0, byte_tokenizer(), 32, seed=0, clusters=2)
    for client in range(3):
        shift = client % 2
        assert torch.equal(federated.train[client].labels, (torch.tensor(train[client].labels).long() + shift) % 2)
        assert torch.equal(federated.test[client].labels, (torch.tensor(test[client].labels).long() + shift) % 2)
    capped = load_client_tasks(task, "train", max_examples=5, seed=1)
    assert [len(client.labels) for client in capped] == [5, 5, 5]
    assert all(set(c.texts) <= set(t.texts) for c, t in zip(capped, train, strict=True))


def test_one_file_per_client_refuses_what_does_not_fit(tmp_path):
    task = _per_file_task(tmp_path, _client_files(tmp_path))
    with pytest.raises(UserError, match=r"has 4 clients and 3 files, one per client"):
        build_federated_task(task, 4, 1.0, byte_tokenizer(), 32, seed=0)
    with pytest.raises(UserError, match="is read one file per client"):
        load_task(task, "train")
    with pytest.raises(UserError, match="is not read one file per client"):
        load_client_tasks(_csv_task(tmp_path / "client-0.csv"), "train")
    with pytest.raises(UserError, match=r"gone\.csv does not exist"):
        load_client_tasks(_per_file_task(tmp_path, ["client-0.csv", "gone.csv"]), "train")


def test_bad_labelled_data_is_one_message(tmp_path):
    _movie_frame(verdict=lambda i: "good").to_csv(tmp_path / "all-good.csv", index=False)
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not parquet PAR1")
    for task, message in [
        (_csv_task(tmp_path / "all-good.csv"), r"every row of .*all-good\.csv has the label 'good'"),
        (_csv_task(tmp_path / "empty.csv"), r"empty\.csv is empty"),
        (_csv_task(tmp_path / "broken.parquet"), r"cannot read .*broken\.parquet as Parquet"),
        (_csv_task(tmp_path / "all-good.csv", label_column="grade"), r"has no column \['grade'\]; its columns are"),
    ]:
        with pytest.raises(UserError, match=message) as raised:
            load_task(task, "train")
        assert raised.value.fix
    one_class_clients = _per_file_task(tmp_path, ["all-good.csv", "all-good.csv"])
    with pytest.raises(UserError, match=r"every row of the 2 client files has the label 'good'") as raised:
        load_client_tasks(one_class_clients, "train")
    assert "['bad']" in raised.value.fix


def test_a_recipe_reads_one_file_per_client(tmp_path):
    names = _client_files(tmp_path)
    raw = yaml.safe_load((Path(__file__).parent / "recipes" / "tiny-classification.yaml").read_text())
    task = {key: value for key, value in raw["task"].items() if key not in ("clients", "dirichlet_alpha")}
    raw["task"] = {**task, "name": "movies", "path": str(tmp_path), "files": "client-*.csv",
                   "text_columns": ["review"], "label_column": "verdict", "labels": ["bad", "good"]}
    recipe = validate_recipe(raw)
    assert (recipe.task.files, recipe.task.clients) == (names, 3)
    assert recipe.user_names == ["client_0", "client_1", "client_2"]
    assert recipe.task.spec() == _per_file_task(tmp_path, names)
    federated = dev.federated_task(Job(recipe, 0, tmp_path))
    for client, examples in enumerate(load_client_tasks(recipe.task.spec(), "train", 240, recipe.split_seed)):
        assert torch.equal(federated.train[client].labels, torch.tensor(examples.labels, dtype=torch.long))
    for changes, message in [
        ({"clients": 4}, r"task.clients=4, but task.files names 3 files"),
        ({"clients": 2}, r"task.clients=2, but task.files names 3 files"),
        ({"files": "*.parquet"}, r"task.files '\*\.parquet' matches no file in"),
        ({"dirichlet_alpha": 0.5}, r"dirichlet_alpha deals one data set over the clients"),
        ({"path": None, "files": None}, r"unknown task 'movies'"),
    ]:
        with pytest.raises(UserError, match=message):
            validate_recipe({**raw, "task": {**raw["task"], **changes}})


# ---------------------------------------------------------------- partitions


def test_dirichlet_rows_sum_to_one():
    proportions = dirichlet_proportions(num_classes=4, num_clients=7, alpha=0.5, seed=0)
    assert proportions.shape == (4, 7)
    np.testing.assert_allclose(proportions.sum(axis=1), 1.0)
    np.testing.assert_array_equal(proportions, dirichlet_proportions(4, 7, 0.5, seed=0))


def _mean_max_label_share(labels, clients):
    shares = [max(Counter(labels[i] for i in client).values()) / len(client) for client in clients]
    return float(np.mean(shares))


def test_smaller_alpha_gives_more_label_skew():
    labels = [i % 5 for i in range(2000)]
    skewed, _ = dirichlet_partition(labels, num_clients=10, alpha=0.1, seed=0)
    near_iid, _ = dirichlet_partition(labels, num_clients=10, alpha=100.0, seed=0)
    assert _mean_max_label_share(labels, skewed) > 0.6
    assert _mean_max_label_share(labels, near_iid) < 0.35
    assert _mean_max_label_share(labels, skewed) > _mean_max_label_share(labels, near_iid)


def test_partition_covers_every_index_exactly_once():
    labels = [i % 3 for i in range(301)]
    proportions = dirichlet_proportions(3, 6, alpha=0.3, seed=1)
    clients = partition_by_proportions(labels, proportions, seed=1)
    assert len(clients) == 6
    assert sorted(i for client in clients for i in client) == list(range(301))
    assert clients == partition_by_proportions(labels, proportions, seed=1)


def test_same_proportions_give_test_data_the_client_skew():
    train_labels, test_labels = [i % 4 for i in range(4000)], [i % 4 for i in range(1000)]
    train, proportions = dirichlet_partition(train_labels, num_clients=5, alpha=0.2, seed=2)
    test = partition_by_proportions(test_labels, proportions, seed=2)
    for train_client, test_client in zip(train, test, strict=True):
        train_counts = np.bincount([train_labels[i] for i in train_client], minlength=4) / 1000
        test_counts = np.bincount([test_labels[i] for i in test_client], minlength=4) / 250
        np.testing.assert_allclose(train_counts, test_counts, atol=0.01)


def test_min_examples_retry_and_impossible_case():
    labels = [i % 2 for i in range(40)]
    first_draws = [partition_by_proportions(labels, dirichlet_proportions(2, 5, 1.0, seed), seed) for seed in (0, 1)]
    assert all(min(len(client) for client in draw) < 2 for draw in first_draws)  # so seeds 0 and 1 are redrawn
    clients, proportions = dirichlet_partition(labels, num_clients=5, alpha=1.0, seed=0, min_examples=2)
    assert min(len(client) for client in clients) >= 2
    np.testing.assert_array_equal(proportions, dirichlet_proportions(2, 5, 1.0, seed=2))
    with pytest.raises(UserError, match=r"num_clients=30.*40 examples.*alpha=0.1") as error:
        dirichlet_partition(labels, num_clients=30, alpha=0.1, seed=0)
    assert "fewer clients" in str(error.value)


def test_bad_partition_inputs_raise_user_error():
    with pytest.raises(UserError, match="alpha"):
        dirichlet_proportions(2, 3, alpha=0.0, seed=0)
    with pytest.raises(UserError, match="label 2 at index 1"):
        partition_by_proportions([0, 2], dirichlet_proportions(2, 3, 1.0, seed=0), seed=0)


def test_label_bins_are_equal_width():
    assert label_bins([0.0, 0.9, 1.0, 2.5, 4.99, 5.0]) == [0, 0, 1, 2, 4, 4]
    assert label_bins([1.0, 2.0, 3.0], num_bins=2) == [0, 1, 1]
    assert label_bins([3.0, 3.0]) == [0, 0]
    assert label_bins([]) == []


def test_data_seed_fixes_the_partition_across_training_seeds(tmp_path):
    recipe_path = Path(__file__).parent / "recipes" / "tiny-classification.yaml"

    def labels_of_client_0(*overrides: str) -> torch.Tensor:
        recipe = load_recipe(recipe_path, list(overrides))
        return dev.federated_task(Job(recipe, 0, tmp_path)).train[0].labels

    same_data = labels_of_client_0("seed=1", "data_seed=0"), labels_of_client_0("seed=2", "data_seed=0")
    assert torch.equal(*same_data)
    assert not torch.equal(labels_of_client_0("seed=1"), labels_of_client_0("seed=2"))
