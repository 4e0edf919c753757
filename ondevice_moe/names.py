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


MIXTURE_SUFFIX = "_mixture"
"""A per-user score of a method's second prediction (FedEM's π-mixture of its centres) carries this
suffix; the report summarises it as a method ``<method>-mixture``."""
