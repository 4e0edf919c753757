"""Routing pictures of one user's trained model (``ondevice-moe inspect``).

The page shows, for one method and user of a finished run: the tokens of a text coloured
by the expert each layer's router chose (CoMiGS Fig. 6–7), each expert's score per layer
over the rounds (CoMiGS Fig. 4/8) and the bytes the user's device sent and received per
round. Client-level routers (FLoRAL's π, FDLoRA) are drawn as one bar per layer, Flow's
per-instance policy as its probability of the global copy per instance and layer; routers
that do not choose (uniform, one expert) are said to have nothing to show.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from ondevice_moe.destination import check_file_destination
from ondevice_moe.inspect.capture import (
    capture_instance_policy,
    capture_token_routing,
    client_weights,
    routes_tokens,
)
from ondevice_moe.inspect.page import (
    Expert,
    bytes_table,
    client_bars,
    html_page,
    image,
    legend,
    score_table,
    token_rows,
)
from ondevice_moe.inspect.plots import (
    expert_colours,
    plot_device_bytes,
    plot_instance_policy,
    plot_score_grid,
    plot_token_grid,
)
from ondevice_moe.inspect.rounds import FLOW_EXPERTS, PI_ROW, device_bytes, score_grid
from ondevice_moe.inspect.text import page_instances, page_text
from ondevice_moe.report import MetricsLog
from ondevice_moe.routing.instance_policy import instance_policy
from ondevice_moe.run_model import UserModel, open_user_model


def write_inspection(run_dir: Path, method: str, user: str, text: str | None, out: Path,
                     text_source: str = "your text") -> list[Path]:
    """Write the page ``out`` and its PNGs (``<out stem>_*.png`` beside it); returns every file written."""
    check_file_destination(out, "--to", "routing.html")
    opened = open_user_model(Path(run_dir), method, user)
    layout = opened.job.method.layouts[opened.device]
    names = layout.expert_names if layout is not None else []
    colours = expert_colours(names)
    experts = [Expert(name, spec.kind, spec.role, colours[name])
               for name, spec in zip(names, layout.experts if layout else (), strict=True)]
    pngs: list[Path] = []
    recipe = opened.recipe
    sections = [f"<h1>Routing of {escape(method)} for user {escape(user)}</h1>",
                f'<p class="note">Run {escape(str(run_dir))} (recipe {escape(recipe.name)}, model '
                f"{escape(recipe.model.name)}); user {escape(user)} trains on device {opened.device}.</p>",
                legend(experts) if experts else ""]
    sections += _routing_section(opened, text, text_source, experts, out, pngs)
    records = MetricsLog(Path(run_dir) / "metrics.jsonl").read()
    grid = score_grid(records, method, user, names)
    sections.append("<h2>Expert scores over rounds</h2>")
    if grid is None:
        sections.append('<p class="note">metrics.jsonl logs no expert scores for this method.</p>')
    else:
        path = plot_score_grid(grid, f"{method}, user {user}: mean routing weight per layer and round",
                               _png(out, "scores", pngs))
        what = ("the device's π after the round" if grid.layers == [PI_ROW] else
                "the mean probability q of each copy of the layer on the round's data" if grid.experts == FLOW_EXPERTS
                else "the mean routing weight the expert took at that layer over the round's local iterations")
        sections += [f'<p class="note">CoMiGS Fig. 4/8: rows are layers, columns rounds; the colour is {what} '
                     f"(from metrics.jsonl): white is an even split (1/{len(grid.experts)}), red more, blue less.</p>",
                     image(path, "expert scores"), score_table(grid)]
    traffic = device_bytes(records, method, user)
    sections.append("<h2>Communication</h2>")
    if traffic is None:
        sections.append('<p class="note">metrics.jsonl logs no rounds for this method.</p>')
    else:
        whose = (f"the bytes device {opened.device} uploaded and downloaded" if traffic.per_device else
                 "the mean bytes per device (this run predates per-device byte records)")
        path = plot_device_bytes(traffic, _png(out, "bytes", pngs))
        sections += [f'<p class="note">Per round, {whose}.</p>', image(path, "bytes per round"), bytes_table(traffic)]
    out.write_text(html_page(f"{method} / {user}", sections), encoding="utf-8")
    return [out, *pngs]


def _routing_section(opened: UserModel, text: str | None, text_source: str, experts: list[Expert], out: Path,
                     pngs: list[Path]) -> list[str]:
    """The routing of the text (per-token routers), the client-level weights, or why there is nothing to show."""
    model = opened.model
    sections = ["<h2>Routing</h2>"]
    if routes_tokens(model):
        shown = page_text(opened, text, text_source)
        routing = capture_token_routing(model, shown.input_ids, shown.tokens, [e.name for e in experts])
        colours = {e.name: e.colour for e in experts}
        path = plot_token_grid(routing, colours, _png(out, "tokens", pngs))
        return [*sections, f'<p class="note">{escape(shown.source)} Each token is coloured by the expert with the '
                f"largest routing weight at that layer (CoMiGS Fig. 6–7); a paler colour means a closer call. Hover a "
                "token for every expert's weight.</p>", token_rows(routing, colours),
                image(path, "chosen expert per token")]
    weights = client_weights(model)
    if weights is not None:
        what = ("FLoRAL's π: one mixture for the whole device, the same at every layer and for every input"
                if "all layers" in weights else "the device's fitted weights, one vector per layer, for every token")
        return [*sections, f'<p class="note">Client-level routing: {what}. No text is needed.</p>',
                client_bars(weights, experts)]
    if instance_policy(model) is not None:
        inputs, labels, source = page_instances(opened)
        q0 = capture_instance_policy(model, inputs)
        path = plot_instance_policy(q0, labels, _png(out, "policy", pngs))
        hard = ", ".join(f"layer {j}: {100 * float((row >= 0.5).mean()):.0f}%" for j, row in enumerate(q0))
        causal = " (a language model routes each position on its context; shown: each block's last)" \
            if opened.recipe.is_language_modelling else ""
        return [*sections, f'<p class="note">{escape(source)} Flow routes each instance, not each token: per '
                "routed layer (per block of a Hugging Face model), ψ gives the probability q of the global copy "
                f"(Flow eq. 2){causal}; at inference the hard policy round(q) picks one copy. Instances on the "
                f"global copy: {hard}.</p>",
                image(path, "Flow's policy per instance")]
    why = ("it has no experts" if not experts else "it holds a single expert" if len(experts) == 1
           else "its router mixes every expert with fixed weights")
    return [*sections, f'<p class="note">No routing to show for {escape(opened.job.method.name)}: {why}.</p>']


def _png(out: Path, what: str, pngs: list[Path]) -> Path:
    path = out.with_name(f"{out.stem}_{what}.png")
    pngs.append(path)
    return path
