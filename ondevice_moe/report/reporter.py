"""What a family of methods adds to a run's ``summary.json``, its ``report.md`` and ``ondevice-moe
compare``'s tables.

The core summarises every method alike: each user's last values (:data:`~.summary.VALUE_KEYS`),
their mean and std over users, uploads, drops. A family with figures of its own (a global model
beside a personalised one, cluster centres scored on every source) brings a :class:`Reporter` from
its folder; the method registry lists it beside the family's methods, and whoever summarises, writes
or compares runs hands over the registered reporters. Every hook reads data only: a reporter whose
figures a run does not hold adds nothing, so one list serves every run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

Records = dict[str, dict[str, Any]]  # user → that user's last evaluation record
Values = Callable[[Records, list[str]], dict[str, Any]]  # the core's per-user values, mean and std


class Reporter:
    """A method family's part of the summary, the report and the comparison; the base adds nothing."""

    #: Evaluation record keys (``user_<i>/`` removed) → their short names in ``summary.json``.
    value_keys: Mapping[str, str] = MappingProxyType({})
    #: Of those short names, the ones ``compare --against`` tests too, where both methods hold them.
    compared: tuple[str, ...] = ()

    def entry_fields(self, final: Records, users: list[str]) -> dict[str, Any]:
        """Fields this family adds to a method's summary entry, from each user's last evaluation."""
        return {}

    def extra_methods(self, name: str, entry: dict[str, Any], final: Records, users: list[str],
                      values: Values) -> dict[str, dict[str, Any]]:
        """Rows this family adds to the summary right after method ``name`` (a second prediction of the
        same run), by name; ``values`` summarises per-user records as the core does."""
        return {}

    def sections(self, summary: dict[str, Any]) -> list[str]:
        """Lines of ``report.md`` after the results table."""
        return []

    def compare_tables(self, summaries: list[dict[str, Any]]) -> list[str]:
        """Markdown tables ``ondevice-moe compare`` adds over the runs' summaries."""
        return []

    def entry_problem(self, name: str, entry: dict[str, Any]) -> str | None:
        """What in method ``name``'s summary entry (read from a file that may be damaged or crafted) the
        family's tables cannot read, or ``None``."""
        return None
