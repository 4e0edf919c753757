"""The page's pictures as PNG files: expert scores per layer over rounds (CoMiGS Fig. 4/8),
the chosen expert per token and layer (CoMiGS Fig. 6–7), Flow's policy per instance and
layer, a device's bytes over rounds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.colors import ListedColormap

from ondevice_moe.inspect.capture import TokenRouting
from ondevice_moe.inspect.rounds import DeviceBytes, ScoreGrid
from ondevice_moe.report import format_bytes, pyplot, save_figure

plt = pyplot()  # the inspect page is all pictures

# Shared experts in cool colours, private ones in warm colours (tab10).
SHARED_COLOURS = ("#1f77b4", "#2ca02c", "#17becf", "#9467bd", "#7f7f7f")
PRIVATE_COLOURS = ("#ff7f0e", "#d62728", "#e377c2", "#8c564b", "#bcbd22")
MAX_GRID_TOKENS = 96  # the token × layer picture stays readable; the page shows every token


def expert_colours(experts: list[str]) -> dict[str, str]:
    """A colour per expert name (``shared_<i>`` / ``private_<i>``), by role."""
    counts = {"shared": 0, "private": 0}
    colours = {}
    for name in experts:
        role = "private" if name.startswith("private") else "shared"
        palette = PRIVATE_COLOURS if role == "private" else SHARED_COLOURS
        colours[name] = palette[counts[role] % len(palette)]
        counts[role] += 1
    return colours


def plot_score_grid(grid: ScoreGrid, title: str, path: Path) -> Path:
    """One heat map per expert: rows = layers, columns = rounds, colour = the expert's score,
    white at an even split over the experts, red above it and blue below."""
    panels = len(grid.experts)
    height = 1.6 + 0.22 * len(grid.layers)
    figure, axes = plt.subplots(1, panels, figsize=(1.2 + 2.6 * panels, height), squeeze=False, sharey=True)
    even = 1.0 / panels
    spread = max(float(np.nanmax(np.abs(grid.scores - even), initial=0.0)), 0.05)
    for axis, name, scores in zip(axes[0], grid.experts, grid.scores, strict=True):
        image = axis.imshow(scores, vmin=even - spread, vmax=even + spread, cmap="RdBu_r", aspect="auto",
                            interpolation="nearest")
        axis.set_title(name, fontsize=9)
        axis.set_xticks(range(len(grid.rounds)), [str(r) for r in grid.rounds], fontsize=8)
        axis.set_xlabel("round", fontsize=8)
        axis.set_yticks(range(len(grid.layers)), grid.layers, fontsize=7)
    figure.colorbar(image, ax=axes[0][-1], label=f"score (white: {even:.2f})")
    figure.suptitle(title, fontsize=10)
    return save_figure(figure, path)


def plot_token_grid(routing: TokenRouting, colours: dict[str, str], path: Path) -> Path:
    """The chosen expert per layer (rows) and token (columns) for the first tokens."""
    chosen = routing.chosen[:, :MAX_GRID_TOKENS]
    layers, tokens = chosen.shape
    figure, axis = plt.subplots(figsize=(min(2 + 0.16 * tokens, 18), 1 + 0.22 * layers))
    axis.imshow(chosen, cmap=ListedColormap([colours[name] for name in routing.experts]),
                vmin=-0.5, vmax=len(routing.experts) - 0.5, aspect="auto", interpolation="nearest")
    axis.set_xticks(range(tokens), [t.replace("\n", "⏎").strip() or "␣"
                                                for t in routing.tokens[:tokens]], rotation=90, fontsize=6)
    axis.set_yticks(range(layers), [f"layer {layer}" for layer in range(layers)], fontsize=6)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[name]) for name in routing.experts]
    axis.legend(handles, routing.experts, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    axis.set_title("expert with the largest routing weight, per layer and token", fontsize=9)
    return save_figure(figure, path)


def plot_instance_policy(q0: np.ndarray, labels: list[str], path: Path) -> Path:
    """Flow's ``q_0`` (the global copy's probability) per routed layer (rows) and instance (columns)."""
    layers, instances = q0.shape
    figure, axis = plt.subplots(figsize=(min(max(6.0, 2.5 + 0.22 * instances), 18), 1.6 + 0.3 * layers))
    image = axis.imshow(q0, vmin=0.0, vmax=1.0, cmap="RdBu_r", aspect="auto", interpolation="nearest")
    axis.set_xticks(range(instances), labels, rotation=90, fontsize=7)
    axis.set_yticks(range(layers), [f"layer {layer}" for layer in range(layers)], fontsize=7)
    axis.set_xlabel("test instance (label)", fontsize=8)
    figure.colorbar(image, ax=axis, label="q of the global copy")
    axis.set_title("Flow's policy: red takes the global copy, blue the local one", fontsize=9)
    return save_figure(figure, path)


def plot_device_bytes(traffic: DeviceBytes, path: Path) -> Path:
    """Upload and download bytes of the device per round."""
    figure, axis = plt.subplots(figsize=(5.5, 3.2))
    width = 0.38
    x = np.arange(len(traffic.rounds))
    axis.bar(x - width / 2, traffic.up, width, label="upload", color="tab:blue")
    axis.bar(x + width / 2, traffic.down, width, label="download", color="tab:orange")
    axis.set_xticks(x, [str(r) for r in traffic.rounds])
    axis.set_xlabel("round")
    top = max([*traffic.up, *traffic.down, 1.0])
    ticks = np.linspace(0, top, 5)
    axis.set_yticks(ticks, [format_bytes(t) for t in ticks])
    axis.set_ylim(0, top * 1.3)  # room for the legend above the bars
    axis.set_ylabel("bytes" + ("" if traffic.per_device else " (mean per device)"))
    axis.legend(loc="upper left", ncol=2)
    return save_figure(figure, path)
