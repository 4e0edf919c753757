"""The recipe's ``logging:`` section: where a run's records go besides ``metrics.jsonl``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator


class LoggingSection(BaseModel):
    """Experiment trackers fed from the records the server writes to ``metrics.jsonl``.

    ``tensorboard``: event files under ``<run folder>/tensorboard/<method>/`` (one TensorBoard run
    per method). ``mlflow``: an MLflow run per method (run name: the method) in the experiment named
    after the recipe, at ``mlflow_uri`` (default: the local file store ``<run folder>/mlruns``; any
    tracking URI MLflow takes, e.g. ``sqlite:///mlflow.db`` or ``http://host:5000``).
    ``wandb``: a Weights & Biases run per method in project ``wandb_project`` (default: the recipe's name),
    its files under ``<run folder>/wandb/<method>/``; ``wandb_mode`` ``offline`` (no network or account;
    ``wandb sync`` uploads later) or ``online``.
    ``every_step``: each training step's loss, learning rate and gradient norm too, not only each round's figures.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensorboard: bool = False
    mlflow: bool = False
    mlflow_uri: str | None = None
    wandb: bool = False
    wandb_project: str | None = None
    wandb_mode: Literal["offline", "online"] = "offline"
    every_step: bool = True

    @model_validator(mode="after")
    def _uri_needs_mlflow(self) -> LoggingSection:
        if self.mlflow_uri is not None and not self.mlflow:
            raise ValueError("logging.mlflow_uri is where MLflow runs go, but logging.mlflow is false; "
                             "set logging.mlflow: true, or drop mlflow_uri")
        return self

    @property
    def enabled(self) -> bool:
        """Whether any tracker is on."""
        return self.tensorboard or self.mlflow or self.wandb
