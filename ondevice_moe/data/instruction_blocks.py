"""Instructions as blocks of tokens whose loss falls on the response only.

Each instruction becomes one block of ``context_length`` tokens: the prompt, then the response,
then padding. With a tokenizer that has a chat template (SmolLM2-Instruct's), the prompt is the
template applied to the prompt's messages with the assistant's header added, and the response is
what the template adds for the last message (its text and the end of the turn). Without one, the
prompt is the messages' texts joined by blank lines and followed by one, and the response is the
response's text and the end-of-text token: ``"prompt\\n\\nresponse<eos>"``.

``labels`` hold the response's token ids and -100 (:data:`~ondevice_moe.data.blocks.IGNORED`) on
the prompt and the padding, so the model's loss and the perplexity count response tokens only;
``attention_mask`` is 0 on the padding.

Too long an instruction is cut: the prompt's messages keep at least half the block (their start,
say an article's opening), the response takes what is left after the prompt's closing header,
and what the response leaves goes back to the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ondevice_moe.data.blocks import IGNORED, BlockExamples
from ondevice_moe.data.instruction import Instruction
from ondevice_moe.errors import UserError

PLAIN_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class InstructionTokens:
    """An instruction's tokens in three parts: the prompt's messages (``messages``), the header that
    closes the prompt and opens the response (``header``), and the response with its end (``response``)."""

    messages: list[int]
    header: list[int]
    response: list[int]


def instruction_blocks(instructions: list[Instruction], tokenizer, context_length: int) -> BlockExamples:
    """One block per instruction: cut to ``context_length``, padded, labelled on the response only."""
    pad = next((token for token in (tokenizer.pad_token_id, tokenizer.eos_token_id) if token is not None), 0)
    rows = [_padded(*fit(tokenize(instruction, tokenizer), context_length), context_length, pad)
            for instruction in instructions]
    columns = zip(*rows, strict=True) if rows else ([], [], [])
    ids, labels, mask = (torch.tensor(list(column), dtype=torch.long).view(-1, context_length) for column in columns)
    return BlockExamples(ids, labels, mask)


def tokenize(instruction: Instruction, tokenizer) -> InstructionTokens:
    """The instruction's tokens, through the tokenizer's chat template where it has one."""
    if getattr(tokenizer, "chat_template", None):
        messages, header, response = _templated(instruction, tokenizer)
        end: list[int] = []
    else:
        messages = PLAIN_SEPARATOR.join(message.content for message in instruction.prompt)
        header, response = PLAIN_SEPARATOR, instruction.response.content
        end = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return InstructionTokens(_encode(tokenizer, messages), _encode(tokenizer, header),
                             _encode(tokenizer, response) + end)


def _templated(instruction: Instruction, tokenizer) -> tuple[str, str, str]:
    """The chat template's text of the prompt's messages, of the header after them, and of the response
    (a template that rewrites the last message's text leaves no header apart: the whole prompt is then
    its messages, and may be cut at its end)."""
    conversation = [{"role": message.role, "content": message.content} for message in instruction.messages]
    try:
        prompt = tokenizer.apply_chat_template(conversation[:-1], tokenize=False, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception as error:  # jinja2 raises what the template's author chose
        raise UserError(f"the tokenizer's chat template refused a conversation of roles "
                        f"{[message.role for message in instruction.messages]} ({type(error).__name__}: {error})",
                        "give the roles the template expects (e.g. user, then assistant)") from None
    if not whole.startswith(prompt):
        raise UserError("the tokenizer's chat template writes a conversation's prompt differently once the "
                        "response follows, so the response cannot be told from the prompt",
                        "use a tokenizer whose template renders the prompt as the start of the conversation")
    last = instruction.prompt[-1].content
    close = prompt.rfind(last) + len(last) if last in prompt else len(prompt)
    return prompt[:close], prompt[close:], whole[len(prompt):]


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def fit(tokens: InstructionTokens, context_length: int) -> tuple[list[int], int]:
    """The instruction cut to ``context_length`` tokens (see the module's docstring), and how many
    of them are the prompt's."""
    kept_messages = max(context_length - len(tokens.header) - len(tokens.response),
                        min(len(tokens.messages), context_length // 2))
    prompt = tokens.messages[:kept_messages] + tokens.header
    response = tokens.response[: context_length - len(prompt)]
    if not response:
        raise UserError(f"data.context_length={context_length} leaves no room for a response after the "
                        f"prompt's {len(prompt)} tokens", "raise data.context_length")
    return prompt + response, len(prompt)


def _padded(ids: list[int], prompt_length: int, context_length: int, pad: int
            ) -> tuple[list[int], list[int], list[int]]:
    """Input ids, labels and attention mask of one block."""
    padding = context_length - len(ids)
    labels = [IGNORED] * prompt_length + ids[prompt_length:] + [IGNORED] * padding
    return ids + [pad] * padding, labels, [1] * len(ids) + [0] * padding


__all__ = ["InstructionTokens", "fit", "instruction_blocks", "tokenize"]
