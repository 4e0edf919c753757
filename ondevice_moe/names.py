"""Names that become parts of paths: a recipe's name, a method's name or label.

A name is joined to a folder (``runs/<recipe>``, ``checkpoints/<method>``, a device's
``state-dir/<recipe>/<method>``), so it must stay inside that folder: letters, digits and
``. _ + -``, not starting with a dot, at most 100 characters. Anything else (``/tmp/x``,
``..``, ``a/b``) is refused where the recipe is validated, never joined.
"""

from __future__ import annotations

import re

PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}")


def is_plain_name(name: str) -> bool:
    """Whether ``name`` can be one path component that stays inside its folder."""
    return PLAIN_NAME.fullmatch(name) is not None


def name_problem(what: str, name: str) -> str | None:
    """Why ``name`` (a ``what``) cannot name a folder, or ``None`` when it can."""
    if is_plain_name(name):
        return None
    return (f"{what} {name!r} cannot name a folder: use letters, digits and . _ + - only "
            "(not starting with a dot, at most 100 characters)")


def folder_name(method_name: str) -> str:
    """The folder of a method's files: its name with every character outside the plain set (the ``/``
    of ``hermes-w/o-A``, the ``:`` of a mixture's derived name) turned into ``_``. Recipe validation
    checks that the methods' folders differ; a user's own ``label`` must be a plain name already."""
    return re.sub(r"[^A-Za-z0-9._+-]", "_", method_name).lstrip(".")[:100] or "_"



_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_UNSAFE_BUT_NEWLINES = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, keep_newlines: bool = False) -> str:
    """``text`` as the toolkit shows it: every control character (terminal ANSI and OSC sequences begin
    with one: a name could retitle the window, hide text, or forge a line) and every bidirectional
    override shown as its escape (``\\x1b``), never sent as itself."""
    pattern = _UNSAFE_BUT_NEWLINES if keep_newlines else _UNSAFE
    return pattern.sub(lambda found: found.group().encode("unicode_escape").decode("ascii"), text)


def markdown_cell(text: str) -> str:
    """``text`` as one cell of a Markdown table, or part of one line of Markdown: on one line,
    :func:`printable`, with HTML's ``&``, ``<`` and ``>`` as entities and ``|`` escaped, so a user's
    name cannot end a cell, add a row, or bring markup into a report or a model card."""
    return printable(" ".join(text.split("\n"))).replace("&", "&amp;").replace("<", "&lt;").replace(
        ">", "&gt;").replace("|", "\\|")
