"""What a run leaves behind: ``metrics.jsonl`` (:mod:`.log`), ``summary.json`` (:mod:`.summary`),
``report.md`` (:mod:`.markdown`) and plots (:mod:`.plots`)."""

from __future__ import annotations

from ondevice_moe.report.log import CorruptLog, MetricsLog, step_losses, step_series
from ondevice_moe.report.markdown import markdown_table, write_report
from ondevice_moe.report.plots import (
    PANEL_COLUMNS,
    PHASE_LOSSES,
    SCORE_KEY,
    integer_ticks,
    plot_communication,
    plot_expert_scores,
    plot_loss_curves,
    plot_rounds,
    pyplot,
    save_figure,
)
from ondevice_moe.report.summary import (
    DIVERGED,
    ERROR_KEYS,
    NOT_MEASURED,
    ROUND_KEYS,
    VALUE_KEYS,
    finite_json,
    format_bytes,
    score_title,
    summarize,
    table_rows,
)

__all__ = [
    "DIVERGED", "ERROR_KEYS", "NOT_MEASURED", "PANEL_COLUMNS", "PHASE_LOSSES", "ROUND_KEYS",
    "SCORE_KEY", "VALUE_KEYS", "CorruptLog", "MetricsLog", "finite_json", "format_bytes",
    "integer_ticks", "markdown_table", "plot_communication", "plot_expert_scores", "plot_loss_curves",
    "plot_rounds", "pyplot", "save_figure", "score_title", "step_losses", "step_series", "summarize", "table_rows",
    "write_report",
]
