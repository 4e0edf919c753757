"""Experiment tracking: the recipe's ``logging:`` section and the trackers it turns on.

The server writes every record to ``metrics.jsonl``; with ``logging.tensorboard`` or
``logging.mlflow`` the same records also go, as scalars, to TensorBoard event files and an MLflow
run per method (docs/tracking.md).
"""

from ondevice_moe.tracking.log import tracked_log
from ondevice_moe.tracking.section import LoggingSection

__all__ = ["LoggingSection", "tracked_log"]
