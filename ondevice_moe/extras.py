"""Optional parts of the install: what a feature needs beyond the core, and the one line that adds it.

The core install runs the quickstart in Flower's simulation; ``[tracking]`` adds TensorBoard, MLflow and
Weights & Biases (``logging:``), ``[quant]`` bitsandbytes (``model.quantization``), ``[dev]`` the test
tools. A feature whose package is missing stops with a :class:`UserError` naming the extra, where it runs
(the server for trackers, the device for a quantized base), before anything is computed.
"""

from __future__ import annotations

import importlib.util

EXTRA_OF = {"tensorboard": "tracking", "mlflow": "tracking", "wandb": "tracking", "bitsandbytes": "quant"}


def require(module: str, feature: str) -> None:
    """Raise a :class:`UserError` if ``module`` (a key of :data:`EXTRA_OF`) is not importable here."""
    from ondevice_moe.errors import UserError

    if importlib.util.find_spec(module) is None:
        extra = EXTRA_OF[module]
        raise UserError(f"{feature} needs {module}, which is not installed on this machine",
                        f"pip install 'ondevice-moe[{extra}]' (or pip install {module})")


__all__ = ["EXTRA_OF", "require"]
