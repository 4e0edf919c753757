"""The self-contained HTML page: inline CSS, pictures as base64 PNGs, no script, no network."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from html import escape
from pathlib import Path

import numpy as np

from ondevice_moe.inspect.capture import TokenRouting
from ondevice_moe.inspect.rounds import DeviceBytes, ScoreGrid
from ondevice_moe.names import printable
from ondevice_moe.report import format_bytes

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1100px;color:#222;padding:0 1em}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
.note{color:#555}
.legend span.key{display:inline-block;margin:0 1em .3em 0;padding:.1em .5em;border-radius:3px;color:#fff}
.layer{display:flex;align-items:baseline;margin:.15em 0}
.layer b{flex:0 0 5.5em;font-size:.8em;color:#555}
.tokens{font-family:ui-monospace,monospace;font-size:.82em;white-space:pre-wrap;overflow-wrap:anywhere;
line-height:1.55}
.t{border-radius:2px}
table{border-collapse:collapse;font-size:.8em}td,th{border:1px solid #ddd;padding:.15em .45em;text-align:right}
.bar{display:inline-block;height:1em;vertical-align:middle}
img{max-width:100%}
"""


@dataclass(frozen=True)
class Expert:
    """One expert as the legend names it."""

    name: str
    kind: str
    role: str
    colour: str


def image(path: Path, alt: str) -> str:
    """An ``<img>`` holding the PNG at ``path``."""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def legend(experts: list[Expert]) -> str:
    keys = "".join(f'<span class="key" style="background:{e.colour}">{escape(e.name)}: {escape(e.kind)}, '
                   f'{escape(e.role)}</span>' for e in experts)
    return f'<p class="legend">{keys}</p>'


def _rgba(colour: str, alpha: float) -> str:
    red, green, blue = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({red},{green},{blue},{alpha:.2f})"


def token_rows(routing: TokenRouting, colours: dict[str, str]) -> str:
    """One row of coloured tokens per layer (CoMiGS Fig. 6–7): the colour names the expert with
    the largest weight; the stronger the colour, the larger that weight; hovering shows all weights."""
    n = len(routing.experts)
    rows = []
    for layer, (weights, chosen) in enumerate(zip(routing.weights, routing.chosen, strict=True)):
        spans = []
        for token, row, index in zip(routing.tokens, weights, chosen, strict=True):
            name = routing.experts[index]
            strength = (row[index] - 1 / n) / (1 - 1 / n)
            title = " · ".join(f"{e} {w:.2f}" for e, w in zip(routing.experts, row, strict=True))
            text = escape(token.replace("\n", "⏎\n"))
            spans.append(f'<span class="t" data-layer="{layer}" data-expert="{escape(name)}" title="{escape(title)}" '
                         f'style="background:{_rgba(colours[name], 0.2 + 0.7 * float(strength))}">{text}</span>')
        rows.append(f'<div class="layer"><b>layer {layer}</b><span class="tokens">{"".join(spans)}</span></div>')
    return "\n".join(rows)


def client_bars(weights: dict[str, list[float]], experts: list[Expert]) -> str:
    """FLoRAL's π (or FDLoRA's weights) as one stacked bar per layer."""
    rows = []
    for label, vector in weights.items():
        bars = "".join(f'<span class="bar" title="{escape(e.name)} {w:.3f}" style="width:{400 * w:.1f}px;'
                       f'background:{e.colour}"></span>' for e, w in zip(experts, vector, strict=True))
        numbers = ", ".join(f"{e.name} {w:.3f}" for e, w in zip(experts, vector, strict=True))
        rows.append(f'<div class="layer"><b>{escape(label)}</b>{bars}&nbsp;<small>{escape(numbers)}</small></div>')
    return "\n".join(rows)


def score_table(grid: ScoreGrid) -> str:
    """The heat map's numbers, one table per expert (rows = layers, columns = rounds)."""
    parts = []
    for name, scores in zip(grid.experts, grid.scores, strict=True):
        head = "".join(f"<th>round {r}</th>" for r in grid.rounds)
        body = "".join(f"<tr><th>{escape(label)}</th>" + "".join(
            f"<td>{'' if np.isnan(v) else f'{v:.4f}'}</td>" for v in row) + "</tr>"
            for label, row in zip(grid.layers, scores, strict=True))
        parts.append(f'<table data-expert="{escape(name)}"><caption>{escape(name)}</caption>'
                     f"<tr><th></th>{head}</tr>{body}</table>")
    return "<details><summary>the numbers</summary>" + "".join(parts) + "</details>"


def bytes_table(traffic: DeviceBytes) -> str:
    rows = "".join(f"<tr><td>{r}</td><td>{format_bytes(u)}</td><td>{format_bytes(d)}</td></tr>"
                   for r, u, d in zip(traffic.rounds, traffic.up, traffic.down, strict=True))
    return f"<table><tr><th>round</th><th>upload</th><th>download</th></tr>{rows}</table>"


def html_page(title: str, sections: list[str]) -> str:
    """The page of ``sections`` (HTML whose user text is escaped already); every control character in
    it, from routed text, a name or a path, is shown as its escape (``\x1b``), never carried raw."""
    body = "\n".join(sections)
    return printable(f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
                     f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n", keep_newlines=True)
