"""``ondevice-moe inspect``: the routing page of one user's trained model."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ondevice_moe.cli import app
from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.inspect import write_inspection
from ondevice_moe.inspect.capture import (
    capture_instance_policy,
    capture_token_routing,
    client_weights,
    routes_tokens,
)
from ondevice_moe.inspect.plots import expert_colours
from ondevice_moe.inspect.rounds import device_bytes, score_grid
from ondevice_moe.inspect.text import page_text
from ondevice_moe.layout import ExpertSpec, Layout, RouterSpec, attach_layout
from ondevice_moe.mixture import mixtures
from ondevice_moe.recipe import load_recipe
from ondevice_moe.report import MetricsLog
from ondevice_moe.routing import client_mixture
from ondevice_moe.routing.block import BlockRouter
from ondevice_moe.routing.instance_policy import instance_policy
from ondevice_moe.run_model import UserModel, open_user_model
from ondevice_moe.runner import run_recipe

RECIPES = Path(__file__).parent / "recipes"
SPAN = re.compile(r'<span class="t" data-layer="(\d+)" data-expert="(\w+)" title="[^"]*" '
                  r'style="background:rgba\((\d+),(\d+),(\d+),[\d.]+\)">')
NAMES = ["shared_0", "private_0"]
TEXT = "def add(x, y):\n    return x + y  # the news today"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    recipe = load_recipe(RECIPES / "tiny.yaml", ["federation.rounds=2", "federation.local_iterations=1",
                                                 "methods=[{name: comigs, variant: 1G1S}, fedavg, floral]",
                                                 "floral.clusters=2"])
    return run_recipe(recipe, tmp_path_factory.mktemp("run") / "tiny").run_dir


def _router_argmax(model: torch.nn.Module, ids: torch.Tensor) -> list[list[int]]:
    """Each MLP mixture's router, called on that mixture's input: the expert with the largest weight per token."""
    chosen = []

    def route(site, args):
        chosen.append(site.router(args[0]).weights[0].argmax(dim=-1).tolist())

    handles = [site.register_forward_pre_hook(route) for site in mixtures(model)]
    with torch.no_grad():
        model(input_ids=ids[None])
    for handle in handles:
        handle.remove()
    return chosen


def test_token_colours_are_the_routers_argmax_per_layer(tiny_run, tmp_path):
    out = tmp_path / "page.html"
    written = write_inspection(tiny_run, "comigs-1G1S", "news", TEXT, out)
    assert written == [out, *(tmp_path / f"page_{what}.png" for what in ("tokens", "scores", "bytes"))]
    assert all(path.stat().st_size > 0 for path in written)
    page = out.read_text(encoding="utf-8")
    spans = SPAN.findall(page)
    opened = open_user_model(tiny_run, "comigs-1G1S", "news")
    encoded = dev.job_base_model(opened.job).tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    ids = torch.tensor(encoded[: opened.recipe.data.context_length])  # the page cuts to the run's context
    expected = _router_argmax(opened.model, ids)
    assert len(expected) == 2 and len(spans) == 2 * len(ids)
    assert [[NAMES.index(e) for layer, e, *_ in spans if int(layer) == n] for n in range(2)] == expected
    colours = {name: tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for name, c in expert_colours(NAMES).items()}
    assert all(tuple(map(int, rgb)) == colours[name] for _, name, *rgb in spans)
    assert "shared_0: lora, shared" in page and "private_0: lora, private" in page
    assert "http" not in page.replace("http-equiv", "")  # self-contained: no link to anything
    assert page.count("data:image/png;base64,") == 3


def test_hermes_block_routers_are_captured_per_token(tiny_model, tokens):
    layout = Layout(experts=(ExpertSpec("lora", "shared"), ExpertSpec("adapter", "shared"),
                             ExpertSpec("lora", "private")), router=RouterSpec(kind="hermes"), mixing="block")
    model = attach_layout(tiny_model, layout, seed=0).eval()
    assert routes_tokens(model) and client_weights(model) is None
    routing = capture_token_routing(model, tokens[0], [str(t) for t in tokens[0].tolist()], layout.expert_names)
    recorded = [router.current[0] for router in model.modules() if isinstance(router, BlockRouter)]
    assert routing.weights.shape == (len(recorded), tokens.shape[1], 3)
    assert all(torch.allclose(torch.from_numpy(w), r.float()) for w, r in zip(routing.weights, recorded, strict=True))
    assert (routing.weights > 0).sum(axis=-1).max() == 2  # Hermes's top-2 of 3


def test_flows_policy_is_read_per_instance_and_layer():
    recipe = load_recipe(RECIPES / "tiny-flow.yaml")
    model = dev.build_model(Job(recipe, 0, Path()), 0).eval()
    inputs = torch.rand((5, *recipe.task.spec().input_shape), generator=torch.Generator().manual_seed(0))
    q0 = capture_instance_policy(model, {"inputs": inputs})
    expected = instance_policy(model).route(inputs.flatten(1))
    assert q0.shape == (len(expected), 5)
    assert all(torch.allclose(torch.from_numpy(row), q[:, 0]) for row, q in zip(q0, expected, strict=True))
    records = [{"method": "flow", "kind": "train", "user": "client_0", "round": r, "q0_layer_0": 0.1 * r,
                "q0_layer_1": 0.2 * r} for r in (2, 1)]
    grid = score_grid(records, "flow", "client_0", ["private_0"])
    assert grid.experts == ["global", "local"] and grid.rounds == [1, 2]
    assert grid.scores[0].tolist() == [[0.1, 0.2], [0.2, 0.4]]
    assert torch.allclose(torch.from_numpy(grid.scores[1]), torch.tensor([[0.9, 0.8], [0.8, 0.6]], dtype=torch.float64))


def test_heat_map_numbers_are_the_logged_scores(tiny_run, tmp_path):
    records = MetricsLog(tiny_run / "metrics.jsonl").read()
    grid = score_grid(records, "comigs-1G1S", "code", NAMES)
    mine = [r for r in records if r["method"] == "comigs-1G1S" and r["kind"] == "train" and r["user"] == "code"]
    assert grid.rounds == [1, 2] and grid.layers == ["layer 0", "layer 1"]
    for e, name in enumerate(grid.experts):
        for layer in range(2):
            for column, record in enumerate(sorted(mine, key=lambda r: r["round"])):
                assert grid.scores[e, layer, column] == record[f"layer_{layer}/expert_{name}_score"]
    assert grid.scores[0, 0, 0] != grid.scores[0, 1, 0]  # a learned router: layers differ
    out = tmp_path / "page.html"
    write_inspection(tiny_run, "comigs-1G1S", "code", TEXT, out)
    table = out.read_text(encoding="utf-8").split('data-expert="private_0"><caption>')[1]
    assert f"{grid.scores[1, 1, 1]:.4f}" in table.split("</table>")[0]


def test_each_devices_bytes_add_up_to_the_rounds_total(tiny_run):
    records = MetricsLog(tiny_run / "metrics.jsonl").read()
    for record in (r for r in records if r["method"] == "comigs-1G1S" and r["kind"] == "comm"):
        devices = [device_bytes(records, "comigs-1G1S", user) for user in ("code", "news", "reviews")]
        index = record["round"] - 1
        assert all(d.per_device for d in devices)
        assert sum(d.up[index] for d in devices) == record["bytes_up"] > 0
        assert sum(d.down[index] for d in devices) == record["bytes_down"]


def test_a_run_without_per_device_bytes_shows_the_mean_per_device(tiny_run):
    records = [{k: v for k, v in r.items() if k not in ("bytes_up", "bytes_down") or r["kind"] != "train"}
               for r in MetricsLog(tiny_run / "metrics.jsonl").read()]
    traffic = device_bytes(records, "comigs-1G1S", "news")
    comm = [r for r in records if r["method"] == "comigs-1G1S" and r["kind"] == "comm"]
    assert not traffic.per_device and traffic.up == [r["bytes_up"] / r["devices"] for r in comm]


def test_floral_shows_pi_and_fedavg_has_no_routing(tiny_run, tmp_path):
    floral = tmp_path / "floral.html"
    write_inspection(tiny_run, "floral-1pct", "reviews", None, floral)
    pi = client_mixture(open_user_model(tiny_run, "floral-1pct", "reviews").model)
    page = floral.read_text(encoding="utf-8")
    assert "FLoRAL's π" in page and f"shared_0 {pi[0]:.3f}, shared_1 {pi[1]:.3f}" in page
    assert 'class="t"' not in page
    fedavg = tmp_path / "fedavg.html"
    write_inspection(tiny_run, "fedavg", "reviews", TEXT, fedavg)
    assert "No routing to show for fedavg" in fedavg.read_text(encoding="utf-8")


def test_without_text_the_page_routes_the_start_of_the_users_test_split(tiny_run, tmp_path):
    opened = open_user_model(tiny_run, "comigs-1G1S", "reviews")
    shown = page_text(opened, None)
    assert torch.equal(shown.input_ids, dev.user_data(opened.job, 2).test[0])
    assert "first test block of user reviews (32 tokens)" in shown.source
    long = page_text(opened, "word " * 100)
    assert len(long.input_ids) == 32 and "cut to the run's 32-token context" in long.source


def test_a_small_task_has_no_text_to_show():
    recipe = load_recipe(RECIPES / "tiny-digits.yaml")
    opened = UserModel(recipe, Job(recipe, 0, Path()), 0, "client_0", torch.nn.Identity())
    with pytest.raises(UserError, match="without text"):
        page_text(opened, None)


@pytest.mark.parametrize(("arguments", "expected"), [
    (["--method", "comigs-1G1S", "--user", "code", "--text", "x", "--file", "f.txt"], "both --text and --file"),
    (["--method", "comigs-1G1S", "--user", "code", "--file", "missing.txt"], "cannot read --file missing.txt"),
    (["--method", "comigs-1G1S", "--user", "code", "--text", "  "], "your text is empty"),
    (["--method", "comigs-9G", "--user", "code"], "method 'comigs-9G' has no finished result"),
    (["--method", "comigs-1G1S", "--user", "sports"], "no user 'sports'"),
])
def test_bad_input_is_one_clear_error(tiny_run, tmp_path, monkeypatch, arguments, expected):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["inspect", str(tiny_run), *arguments, "--to", "page.html"])
    assert result.exit_code == 2 and expected in result.output and "Traceback" not in result.output
    assert "fix:" in result.output and not (tmp_path / "page.html").exists()


def test_an_unwritable_target_is_one_clear_error(tiny_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for target, expected in (("no/page.html", "folder no does not exist"), (".", "--to . is a folder")):
        result = CliRunner().invoke(app, ["inspect", str(tiny_run), "--method", "comigs-1G1S", "--user", "code",
                                          "--to", target])
        assert result.exit_code == 2 and expected in result.output


def test_the_command_writes_the_page_and_its_pngs(tiny_run, tmp_path):
    source = tmp_path / "snippet.py"
    source.write_text(TEXT, encoding="utf-8")
    result = CliRunner().invoke(app, ["inspect", str(tiny_run), "--method", "comigs-1G1S", "--user", "code",
                                      "--file", str(source), "--to", str(tmp_path / "out.html")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.glob("out*")) == ["out.html", "out_bytes.png", "out_scores.png",
                                                              "out_tokens.png"]
    assert f"File {source} (" in (tmp_path / "out.html").read_text(encoding="utf-8")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs the chromium binary (Debian: apt-get install chromium)")
def test_the_page_renders_in_headless_chromium(tiny_run, tmp_path):
    from PIL import Image

    out = tmp_path / "page.html"
    write_inspection(tiny_run, "comigs-1G1S", "code", TEXT, out)
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1100,1400", out.as_uri()],
                   check=True, capture_output=True, timeout=120)
    pixels = Image.open(shot).convert("RGB")
    assert pixels.size == (1100, 1400)
    seen = {rgb for _, rgb in pixels.getcolors(maxcolors=1 << 20)}
    legend = {tuple(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in expert_colours(NAMES).values()}
    assert legend <= seen, "the legend's expert colours are not on the rendered page"
    assert len(seen) > 50, "the page rendered blank"


def test_a_file_name_with_html_is_shown_as_text_not_markup(tiny_run, tmp_path):
    crafted = tmp_path / "<script>alert(1)<"
    crafted.mkdir()
    source = crafted / "x.py"
    source.write_text(TEXT, encoding="utf-8")
    result = CliRunner().invoke(app, ["inspect", str(tiny_run), "--method", "comigs-1G1S", "--user", "code",
                                      "--file", str(source), "--to", str(tmp_path / "out.html")])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "out.html").read_text(encoding="utf-8")
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;" in page


def test_a_fifo_as_file_is_refused_without_blocking(tiny_run, tmp_path):
    import os

    fifo = tmp_path / "text.fifo"
    os.mkfifo(fifo)
    result = CliRunner().invoke(app, ["inspect", str(tiny_run), "--method", "comigs-1G1S", "--user", "code",
                                      "--file", str(fifo), "--to", str(tmp_path / "out.html")])
    assert result.exit_code == 2 and "is not a regular file" in " ".join(result.output.split())
