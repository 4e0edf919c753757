import pytest
import torch
from datasets import Dataset

from ondevice_moe.data.classification import build_federated_task
from ondevice_moe.data.sources import documents
from ondevice_moe.data.splits import SourceSpec, build_user_data, split_documents, to_blocks
from ondevice_moe.errors import UserError


def _encode(text: str) -> list[int]:
    return [ord(c) % 200 for c in text]


def test_documents_are_dealt_whole_to_one_split():
    docs = [chr(65 + i) * 30 for i in range(20)]  # each document is one repeated letter
    streams = split_documents(docs, _encode, eos_id=250, budgets={"train": 200, "valid": 60, "test": 60}, seed=1)
    letters = {split: {t for t in stream if t != 250} for split, stream in streams.items()}
    assert not letters["train"] & letters["test"]
    assert not letters["valid"] & letters["test"]
    assert not letters["train"] & letters["valid"]
    assert [len(streams[s]) for s in ("train", "valid", "test")] == [200, 60, 60]


def test_split_is_reproducible_and_seed_dependent():
    docs = [f"document {i} " * 5 for i in range(50)]
    budgets = {"train": 300, "valid": 100, "test": 100}
    first = split_documents(docs, _encode, 250, budgets, seed=3)
    assert first == split_documents(docs, _encode, 250, budgets, seed=3)
    assert first != split_documents(docs, _encode, 250, budgets, seed=4)


def test_one_long_document_is_cut_across_the_splits_in_order():
    text = "".join(chr(65 + i % 26) for i in range(500))
    tokens = [*_encode(text), 250]
    streams = split_documents([text], _encode, 250, {"train": 300, "valid": 100, "test": 100}, seed=0)
    assert streams == {"test": tokens[:100], "valid": tokens[100:200], "train": tokens[200:500]}


def test_a_few_long_documents_leave_no_split_empty():
    docs = [chr(65 + i) * 150 for i in range(3)]  # three documents, each most of one split's budget
    streams = split_documents(docs, _encode, 250, {"train": 200, "valid": 200, "test": 200}, seed=0)
    assert [len(streams[split]) for split in ("test", "valid", "train")] == [200, 200, 3 * 151 - 400]
    dealt = sorted(t for stream in streams.values() for t in stream)
    assert dealt == sorted(t for doc in docs for t in [*_encode(doc), 250])  # every token once, none twice


def test_a_one_file_text_folder_yields_train_valid_and_test_blocks(tmp_path, tokenizer):
    (tmp_path / "book.txt").write_text("It was a bright cold day in April. " * 40)
    data = build_user_data("reader", [SourceSpec("text-folder", {"path": str(tmp_path)})], tokenizer,
                           {"train": 640, "valid": 160, "test": 160}, 32, seed=0)
    assert (data.train.shape, data.valid.shape, data.test.shape) == ((20, 32), (5, 32), (5, 32))


def test_blocks_drop_the_ragged_tail():
    blocks = to_blocks(list(range(70)), 32)
    assert blocks.shape == (2, 32)
    assert torch.equal(blocks[1], torch.arange(32, 64))


def test_offline_sources_yield_text():
    for kind in ("python-code", "bbc-news", "rotten-tomatoes", "political-speeches"):
        first = next(iter(documents(kind, {})))
        assert isinstance(first, str) and len(first) > 20, kind


def test_mixture_takes_each_source_in_proportion(tmp_path, tokenizer):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for i in range(30):
        (tmp_path / "a" / f"{i}.txt").write_text("a" * 40)
        (tmp_path / "b" / f"{i}.txt").write_text("b" * 40)
    sources = [SourceSpec("text-folder", {"path": str(tmp_path / "a")}, 3.0),
               SourceSpec("text-folder", {"path": str(tmp_path / "b")}, 1.0)]
    data = build_user_data("mix", sources, tokenizer, {"train": 400, "valid": 80, "test": 80}, 16, seed=0)
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    counts = {t: int((data.train == t).sum()) for t in (a, b)}
    assert counts[a] == pytest.approx(3 * counts[b], rel=0.1)


def test_too_little_text_names_the_user_and_split(tmp_path, tokenizer):
    (tmp_path / "one.txt").write_text("just a few words")
    with pytest.raises(UserError, match=r"user 'tiny' has \d+ (train|valid|test) tokens, fewer than one block"):
        build_user_data("tiny", [SourceSpec("text-folder", {"path": str(tmp_path)})], tokenizer,
                        {"train": 1000, "valid": 100, "test": 100}, 32, seed=0)


def test_own_files_are_a_source_and_the_older_names_read_one_format(tmp_path):
    (tmp_path / "a.txt").write_text("a text file")
    (tmp_path / "table.csv").write_text('body\n"one, with a comma"\n007\n')
    assert list(documents("files", {"path": str(tmp_path / "table.csv"), "text_field": "body"})) == [
        "one, with a comma", "007"]
    assert list(documents("text-folder", {"path": str(tmp_path)})) == ["a text file"]  # the CSV is left out
    lines = tmp_path / "records.log"
    lines.write_text('{"text": "one"}\n{"text": "two"}\n')
    assert list(documents("jsonl", {"path": str(lines)})) == ["one", "two"]  # JSON lines, whatever the extension
    Dataset.from_dict({"body": ["saved"]}).save_to_disk(str(tmp_path / "saved"))
    assert list(documents("saved-dataset", {"path": str(tmp_path / "saved"), "text_field": "body"})) == ["saved"]
    with pytest.raises(UserError, match=r"a `files` source needs `path`"):
        list(documents("files", {}))


def test_jsonl_errors_name_the_file(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine"}\n{not json}\n')
    with pytest.raises(UserError, match=r"cannot read .*data\.jsonl as JSON \(ArrowInvalid: JSON parse error"):
        list(documents("jsonl", {"path": str(path)}))
    path.write_text('{"body": "no text field"}\n')
    with pytest.raises(UserError, match=r"has no column \['text'\]; its columns are \['body'\]"):
        list(documents("jsonl", {"path": str(path)}))


def test_unreadable_file_is_named(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00 not utf-8 \xff")
    with pytest.raises(UserError, match=r"cannot read .*bad\.txt"):
        list(documents("text-folder", {"path": str(tmp_path)}))


@pytest.mark.parametrize("line", ['["a", "list"]', '"just a string"', "3"])
def test_jsonl_line_that_is_not_an_object(tmp_path, line):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(UserError, match=r"cannot read .*data\.jsonl as JSON \(ArrowInvalid"):
        list(documents("jsonl", {"path": str(path)}))


def test_dirichlet_client_without_test_examples_is_named_at_build_time(tokenizer):
    with pytest.raises(UserError, match=r"clients? [\d, ]+ of 8 would get no test examples") as caught:
        build_federated_task("rotten-tomatoes", 8, 0.1, tokenizer, 16, seed=0, max_train_examples=240,
                             max_test_examples=10)
    assert "task.max_test_examples" in caught.value.fix


def test_every_dirichlet_client_gets_test_examples(tokenizer):
    task = build_federated_task("rotten-tomatoes", 3, 1.0, tokenizer, 16, seed=0, max_train_examples=240,
                                max_test_examples=120)
    assert all(len(client) > 0 for client in task.test)
    assert sum(len(client) for client in task.test) == 120


def test_label_shift_clusters_shift_each_clusters_labels(tokenizer):
    plain = build_federated_task("bbc-news", 4, 100.0, tokenizer, 16, seed=0, max_train_examples=200,
                                 max_test_examples=100)
    shifted = build_federated_task("bbc-news", 4, 100.0, tokenizer, 16, seed=0, max_train_examples=200,
                                   max_test_examples=100, clusters=2)
    for client in range(4):
        for split in ("train", "test"):
            before, after = getattr(plain, split)[client], getattr(shifted, split)[client]
            assert torch.equal(before.input_ids, after.input_ids)
            assert torch.equal(after.labels, (before.labels + client % 2) % 5), (client, split)
