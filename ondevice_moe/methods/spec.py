"""What the registry knows of a method: :class:`MethodSpec`, and the kinds of task a method runs on."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from ondevice_moe.methods.base import Method, MethodContext, MethodOptions
from ondevice_moe.report.reporter import Reporter

LANGUAGE, CLASSIFICATION, SMALL = "language-modelling", "classification", "small-model"
ANY_TASK = frozenset({LANGUAGE, CLASSIFICATION, SMALL})


@dataclass(frozen=True)
class MethodSpec:
    """A method's options schema (a :class:`~ondevice_moe.methods.base.MethodOptions`), its builder
    (options and :class:`~ondevice_moe.methods.base.MethodContext` → :class:`~ondevice_moe.methods.base.Method`),
    the tasks it runs on (``language-modelling``, ``classification``, ``small-model``), the recipe
    section (if any) whose keys give its family's shared defaults (``defaults_section``, its schema
    ``section``: a recipe holds it at the top level, ``experts:``, ``fedsoft:``), and the family's
    :class:`~ondevice_moe.report.reporter.Reporter` (if any): its figures in the summary, the report
    and ``compare``."""

    options: type[MethodOptions]
    build: Callable[[Any, MethodContext], Method]
    tasks: frozenset[str] = ANY_TASK
    defaults_section: str | None = None
    reporter: Reporter | None = None
    section: type[BaseModel] | None = None
