"""One exception type for problems the user can fix.

Every :class:`UserError` names what is wrong and how to fix it; the CLI prints
it as one message without a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in the user's input (recipe, files, data) with a suggested fix; the CLI exits with
    ``exit_code``."""

    exit_code = 2

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(problem if fix is None else f"{problem}\n  fix: {fix}")


def failure_line(error: Exception) -> str:
    """``error`` as the one line a run's ``error`` record keeps: a :class:`UserError`'s problem, else
    the exception's type and message."""
    return error.problem if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
