"""What report.md and its plots tell a reader: the run's facts, values on every bar, layer bands."""

from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import yaml

from ondevice_moe import report
from ondevice_moe.recipe import validate_recipe
from ondevice_moe.run_folder import run_facts

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def _summary(dropped: dict[str, int]) -> dict:
    return {"users": ["a"], "metric": "accuracy",
            "methods": {"fedavg": {"per_user": {"a": {"score": 50.0}}, "mean_score": 50.0, "std_score": 0.0,
                                   "upload_bytes_per_round": 10.0, "dropped": dropped}}}


@pytest.mark.parametrize(("dropped", "expected"), [({}, "dropped updates: none"),
                                                   ({"a": 2, "b": 1}, "dropped updates: 3 (see Dropped devices")])
def test_report_states_seed_rounds_devices_versions_and_drops(tmp_path, dropped, expected):
    recipe = validate_recipe(yaml.safe_load(TINY.read_text()) | {"seed": 7, "data_seed": 3})
    facts = run_facts(recipe, _summary(dropped))
    text = report.write_report(tmp_path, "tiny", _summary(dropped), [], facts).read_text()
    assert "seed 7 (data seed 3), 2 rounds, 3 devices, model tiny-gpt2" in text
    assert "written 20" in text and "flwr " in text and "peft " in text
    assert expected in text


def test_layer_bands_cover_every_layer_once_in_order():
    bands = report.layer_bands(list(range(30)))
    assert len(bands) == 6 and [layer for band in bands for layer in band] == list(range(30))
    assert report.layer_bands([0, 1, 2]) == [[0], [1], [2]]
    assert [len(band) for band in report.layer_bands(list(range(8)))] == [2, 2, 1, 1, 1, 1]


def _records() -> list[dict]:
    return [{"method": "m", "kind": "train", "user": "a", "round": r, "iteration": 6.0 * r,
             **{f"layer_{layer}/expert_shared_0_score": 0.5 + 0.01 * layer for layer in range(12)}}
            for r in (1, 2, 3)]


def test_expert_scores_plot_has_a_legend_entry_per_band_and_integer_rounds(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(report, "save_figure", lambda figure, path: figures.append(figure) or path)
    report.plot_expert_scores(_records(), "m", tmp_path / "scores.png")
    axis = figures[0].axes[0]
    assert [text.get_text() for text in axis.get_legend().get_texts()] == ["0–1", "2–3", "4–5", "6–7", "8–9", "10–11"]
    assert axis.get_xlabel() == "round"
    assert all(float(tick).is_integer() for tick in axis.get_xticks())
    plt.close("all")


def test_every_communication_bar_carries_its_value(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(report, "save_figure", lambda figure, path: figures.append(figure) or path)
    records = [{"method": m, "kind": "comm", "bytes_up": size} for m, size in (("ft", 2**30), ("lora", 3 * 2**20))]
    report.plot_communication(records, ["ft", "lora"], tmp_path / "comm.png")
    labels = [text.get_text() for text in figures[0].axes[0].texts]
    assert labels == [report.format_bytes(2**30), report.format_bytes(3 * 2**20)]
    plt.close("all")


def test_a_diverged_user_is_reported_as_diverged_and_the_summary_stays_strict_json(tmp_path):
    import json

    records = [{"method": "fedavg", "round": 2, "kind": "eval", "user": user, "test_ppl_in": value,
                "test_ppl_out": 5.0} for user, value in (("a", float("inf")), ("b", 3.0))]
    records += [{"method": "local", "round": 2, "kind": "eval", "user": user, "test_ppl_in": 4.0,
                 "test_ppl_out": float("nan")} for user in ("a", "b")]
    summary = report.summarize(records, ["fedavg", "local"], ["a", "b"])
    assert summary["methods"]["fedavg"]["diverged"] == ["a"] and summary["methods"]["fedavg"]["mean_in"] is None
    assert summary["methods"]["fedavg"]["mean_out"] == 5.0  # what did not diverge is still averaged
    text = report.write_report(tmp_path, "tiny", summary, []).read_text()
    assert "| fedavg | inf | 3.00 | diverged | 5.00 (0.00) |" in text
    written = json.loads((tmp_path / "summary.json").read_text())  # strict: no Infinity or NaN tokens
    assert written["methods"]["fedavg"]["per_user"]["a"]["in"] is None
    assert "NaN" not in (tmp_path / "summary.json").read_text()
