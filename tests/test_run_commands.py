"""What a finished run does for its users: `generate` from a user's trained model, `eval --data` on a file
of the user's (eval.json), and `eval` with the suite read from the run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from ondevice_moe.cli import app
from ondevice_moe.generate import generate_text
from ondevice_moe.models.tiny import byte_tokenizer
from ondevice_moe.recipe import load_recipe
from ondevice_moe.report import MetricsLog
from ondevice_moe.run_model import open_user_model
from ondevice_moe.runner import run_recipe

TESTS = Path(__file__).parent / "recipes"
DOCS = Path(__file__).parents[1] / "docs"
METHOD = "comigs-1G1S"
cli = CliRunner()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """The tiny recipe's CoMiGS (a shared and a private expert, routers) for one round of six steps, at a
    rate that moves each user's private expert far enough for its model's text to show it."""
    recipe = load_recipe(TESTS / "tiny.yaml", ["federation.rounds=1", "federation.local_iterations=6",
                                               "training.lr=0.05", "training.lr_schedule=constant",
                                               "methods=[{name: comigs, variant: 1G1S}]"])
    return run_recipe(recipe, tmp_path_factory.mktemp("run") / "tiny").run_dir


@pytest.fixture(scope="module")
def classification_run(tmp_path_factory) -> Path:
    """A run folder of the tiny classification recipe whose one finished method, `pretrained`, trains
    nothing: its clients' models are the base classifier, no checkpoint needed."""
    recipe = load_recipe(TESTS / "tiny-classification.yaml", ["methods=[pretrained]"])
    folder = tmp_path_factory.mktemp("cls")
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    MetricsLog(folder / "metrics.jsonl").write({"method": "pretrained", "kind": "done", "rounds": 0})
    return folder


def test_greedy_generation_is_the_argmax_of_the_users_own_model(trained_run):
    prompt = "def main():"
    result = generate_text(trained_run, METHOD, "news", prompt, max_new_tokens=12)
    model = open_user_model(trained_run, METHOD, "news").model
    tokenizer = byte_tokenizer()
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert result.new_tokens == 12
    assert result.continuation == tokenizer.decode(ids[0, -12:], skip_special_tokens=True)


def test_sampling_repeats_for_a_seed_and_each_users_model_writes_its_own_text(trained_run):
    def text(user: str, seed: int) -> str:
        return generate_text(trained_run, METHOD, user, "def main():", 100, temperature=0.5, seed=seed).continuation

    assert text("code", 0) == text("code", 0)
    assert text("code", 0) != text("code", 1)
    assert len({text(user, 0) for user in ("code", "news", "reviews")}) == 3


def test_the_generate_command_prints_the_prompt_and_its_continuation(trained_run):
    result = cli.invoke(app, ["generate", str(trained_run), "--method", METHOD, "--user", "code", "--prompt",
                              "import os", "--max-new-tokens", "8", "--temperature", "1", "--top-k", "50"])
    assert result.exit_code == 0, result.output
    expected = generate_text(trained_run, METHOD, "code", "import os", 8, temperature=1, top_k=50).continuation
    assert expected.strip() and result.output == "import os" + expected + "\n"  # streamed piece by piece


def test_generate_says_when_the_model_wrote_nothing(trained_run):
    result = cli.invoke(app, ["generate", str(trained_run), "--method", METHOD, "--user", "code", "--prompt",
                              "import os", "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output
    blank = not generate_text(trained_run, METHOD, "code", "import os", 3).continuation.strip()
    assert blank == ("the model wrote no text" in result.output)


@pytest.mark.parametrize(("arguments", "problem"), [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "x", "--max-new-tokens", "0"], "not positive"),
    (["--prompt", "x", "--temperature", "-1"], "is negative"),
    (["--prompt", "x", "--max-new-tokens", "300"], "exceed the model's 256 positions"),
    (["--prompt", "x", "--user", "nobody"], "no user 'nobody'"),
])
def test_bad_generate_settings_are_one_clear_error(trained_run, arguments, problem):
    options = {"--method": METHOD, "--user": "code"}
    for flag, value in zip(arguments[::2], arguments[1::2], strict=True):
        options[flag] = value
    result = cli.invoke(app, ["generate", str(trained_run), *[part for pair in options.items() for part in pair]])
    assert result.exit_code == 2 and problem in " ".join(result.output.split()) and "fix:" in result.output


def test_a_classification_run_cannot_generate_and_says_what_to_do(classification_run):
    result = cli.invoke(app, ["generate", str(classification_run), "--method", "pretrained", "--user", "client_0",
                              "--prompt", "a fine film"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and "is a classification run" in output and "eval" in output and "--data" in output


def test_eval_data_gives_each_users_perplexity_on_the_file(trained_run, tmp_path):
    text = (DOCS / "hermes.md").read_text(encoding="utf-8")[:2000]
    data = tmp_path / "mine.txt"
    data.write_text(text, encoding="utf-8")
    result = cli.invoke(app, ["eval", str(trained_run), "--data", str(data)])
    assert result.exit_code == 0, result.output
    written = json.loads((trained_run / "eval.json").read_text())
    tokenizer = byte_tokenizer()
    tokens = [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    blocks = torch.tensor(tokens[: len(tokens) // 32 * 32]).view(-1, 32)
    assert (written["metric"], written["blocks"], written["tokens"]) == ("perplexity", len(blocks), blocks.numel())
    for user in ("code", "news", "reviews"):
        model = open_user_model(trained_run, METHOD, user).model
        with torch.no_grad():
            logits = model(input_ids=blocks).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1))
        assert written["methods"][METHOD][user]["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-5)
        assert f"{written['methods'][METHOD][user]['perplexity']:.2f}" in result.output


@pytest.mark.parametrize("fmt", ["csv", "parquet", "jsonl"])
def test_eval_data_reads_the_formats_training_reads(trained_run, tmp_path, fmt):
    """Rows of a CSV, Parquet or JSON-lines file are documents, as the files source reads them for training:
    the same perplexity as the same documents in a folder of text files."""
    import pandas

    paragraphs = [part for part in (DOCS / "hermes.md").read_text(encoding="utf-8").split("\n\n") if part.strip()][:8]
    table = pandas.DataFrame({"body": paragraphs})
    data = tmp_path / f"mine.{fmt}"
    {"csv": lambda: table.to_csv(data, index=False), "parquet": lambda: table.to_parquet(data),
     "jsonl": lambda: table.to_json(data, orient="records", lines=True)}[fmt]()
    folder = tmp_path / "texts"
    folder.mkdir()
    for index, paragraph in enumerate(paragraphs):
        (folder / f"{index:02d}.txt").write_text(paragraph, encoding="utf-8")
    rows = cli.invoke(app, ["eval", str(trained_run), "--data", str(data), "--text-column", "body", "--out",
                            str(tmp_path / "rows.json")])
    texts = cli.invoke(app, ["eval", str(trained_run), "--data", str(folder), "--out", str(tmp_path / "texts.json")])
    assert rows.exit_code == 0 and texts.exit_code == 0, rows.output + texts.output
    by_rows, by_texts = (json.loads((tmp_path / name).read_text()) for name in ("rows.json", "texts.json"))
    assert by_rows["tokens"] == by_texts["tokens"] > 0
    assert by_rows["methods"] == by_texts["methods"]


def test_eval_data_scores_an_instruction_file_on_its_responses_only(trained_run, tmp_path):
    data = tmp_path / "qa.csv"
    data.write_text("question,answer\nwhat is two and two,four\nname a colour,blue\n", encoding="utf-8")
    result = cli.invoke(app, ["eval", str(trained_run), "--data", str(data), "--prompt-column", "question",
                              "--response-column", "answer", "--out", str(tmp_path / "qa.json")])
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "qa.json").read_text())
    tokenizer = byte_tokenizer()  # no chat template: "prompt\n\nresponse<eos>", the response and <eos> scored
    assert (written["instructions"], written["response_tokens"]) == (2, len("four") + 1 + len("blue") + 1)
    model = open_user_model(trained_run, METHOD, "code").model
    nll, count = 0.0, 0
    for prompt, response in (("what is two and two", "four"), ("name a colour", "blue")):
        prompt_ids = tokenizer(prompt + "\n\n", add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt_ids + tokenizer(response, add_special_tokens=False)["input_ids"]
                            + [tokenizer.eos_token_id]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1]
        nll += float(torch.nn.functional.cross_entropy(logits, ids[0, len(prompt_ids):], reduction="sum"))
        count += ids.shape[1] - len(prompt_ids)
    assert written["methods"][METHOD]["code"]["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)


def test_eval_data_scores_a_classifier_on_a_labelled_file(classification_run, tmp_path):
    from ondevice_moe.models.registry import load_base_model

    lines = [line for line in (DOCS / "hermes.md").read_text(encoding="utf-8").splitlines() if len(line) > 40][:16]
    labels = ["rotten", "fresh", "1", "0"] * 4  # class names or indices, as a task file may hold them
    data = tmp_path / "labelled.jsonl"
    rows = (json.dumps({"review": line, "label": label}) + "\n" for line, label in zip(lines, labels, strict=True))
    data.write_text("".join(rows))
    out = tmp_path / "scores.json"
    result = cli.invoke(app, ["eval", str(classification_run), "--data", str(data), "--text-column", "review",
                              "--out", str(out)])
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())
    base = load_base_model("tiny-bert", num_labels=2, seed=0).model
    tokenizer = byte_tokenizer()
    with torch.no_grad():
        predicted = [int(base(**tokenizer(line, truncation=True, max_length=32, return_tensors="pt")).logits.argmax())
                     for line in lines]
    truth = [{"rotten": 0, "fresh": 1, "0": 0, "1": 1}[label] for label in labels]
    accuracy = 100.0 * sum(p == t for p, t in zip(predicted, truth, strict=True)) / len(truth)
    assert written["examples"] == 16 and written["metric"] == "accuracy"
    assert {user: scores["accuracy"] for user, scores in written["methods"]["pretrained"].items()} == \
        pytest.approx({f"client_{k}": accuracy for k in range(3)})


@pytest.mark.parametrize(("arguments", "problem"), [
    (["--data", "{tmp}/nothing.txt"], "does not exist"),
    (["--data", "{tmp}/short.txt"], "fewer than one block"),
    (["--data", "{tmp}/short.txt", "--split", "valid"], "drop --suite and --split"),
    (["--data", "{tmp}/short.txt", "--out", "{tmp}/no/eval.json"], "does not exist"),
    (["--out", "{tmp}/eval.json"], "add --data FILE"),
    (["--response-column", "a"], "add --data FILE"),
    (["--data", "{tmp}/short.txt", "--text-column", "t", "--response-column", "a"], "or the prompt/response"),
    (["--suite", "glue"], "does not fit this language-modelling run"),
])
def test_bad_eval_options_are_one_clear_error(trained_run, tmp_path, arguments, problem):
    (tmp_path / "short.txt").write_text("too short")
    result = cli.invoke(app, ["eval", str(trained_run), *(a.format(tmp=tmp_path) for a in arguments)])
    assert result.exit_code == 2 and problem in " ".join(result.output.split()) and "fix:" in result.output


def test_eval_suite_is_a_choice_and_the_table_has_no_upload_column(trained_run):
    wrong = cli.invoke(app, ["eval", str(trained_run), "--suite", "wikitext"])
    assert wrong.exit_code == 2 and "'wikitext' is not one of" in " ".join(wrong.output.split())
    result = cli.invoke(app, ["eval", str(trained_run)])  # the suite of the run's own task: lm
    assert result.exit_code == 0, result.output
    summary = json.loads((trained_run / "summary.json").read_text())
    assert f"{summary['methods'][METHOD]['per_user']['news']['in']:.2f}" in result.output
    assert "upload" not in result.output
