"""What report.md and its plots tell a reader: the run's facts, values on every bar, a line per expert,
loss curves."""

from pathlib import Path
from types import MappingProxyType

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


def _records() -> list[dict]:
    return [{"method": "m", "kind": "train", "user": "a", "round": r, "iteration": 6.0 * r,
             **{f"layer_{layer}/expert_shared_0_score": 0.5 + 0.01 * layer for layer in range(12)},
             **{f"layer_{layer}/expert_private_0_score": 0.5 - 0.01 * layer for layer in range(12)}}
            for r in (1, 2, 3)]


def _drawn(monkeypatch) -> list:
    figures: list = []
    monkeypatch.setattr(report.plots, "save_figure", lambda figure, path: figures.append(figure) or path)
    return figures


def test_expert_scores_plot_draws_a_line_per_expert_in_a_band_over_the_layers(tmp_path, monkeypatch):
    figures = _drawn(monkeypatch)
    report.plot_expert_scores(_records(), "m", tmp_path / "scores.png")
    axis = figures[0].axes[0]
    assert [text.get_text() for text in axis.get_legend().get_texts()] == ["shared_0", "private_0"]
    shared, private = axis.get_lines()  # two lines, not one per layer
    assert list(shared.get_ydata()) == pytest.approx([0.5 + 0.01 * 5.5] * 3)  # the mean over 12 layers
    assert list(private.get_ydata()) == pytest.approx([0.5 - 0.01 * 5.5] * 3)
    band = axis.collections[0].get_paths()[0].vertices[:, 1]
    assert (band.min(), band.max()) == pytest.approx((0.5, 0.61))  # lowest to highest layer
    assert axis.get_xlabel() == "round"
    assert all(float(tick).is_integer() for tick in axis.get_xticks())
    plt.close("all")


def test_loss_curves_average_each_step_over_devices_and_show_phases_and_tests(tmp_path, monkeypatch):
    records = [{"method": "steps", "kind": "train", "user": user, "round": r, "iteration": 3.0 * r,
                "train_loss": 0.0, "step_losses": [10.0 * r + s + shift for s in (1, 2, 3)]}
               for r in (1, 2) for user, shift in (("a", 0.0), ("b", 1.0))]
    records += [{"method": "phases", "kind": "train", "user": user, "round": r, "iteration": 4.0 * r,
                 "train_loss": r + shift, "train_loss_local": 5.0 * r + shift}
                for r in (1, 2) for user, shift in (("a", 0.0), ("b", 2.0))]
    records += [{"method": method, "kind": "eval", "user": user, "round": r, "score": 50.0 + r}
                for method, rounds in (("pretrained", [0]), ("steps", [1, 2]), ("phases", [1, 2]))
                for r in rounds for user in ("a", "b")]
    figures = _drawn(monkeypatch)
    report.plot_loss_curves(records, ["pretrained", "steps", "phases"], tmp_path / "loss.png")
    steps_axis, phase_axis, test_axis = figures[0].axes
    by_label = {line.get_label(): line for line in steps_axis.get_lines()}
    assert list(by_label["steps"].get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert list(by_label["steps"].get_ydata()) == [11.5, 12.5, 13.5, 21.5, 22.5, 23.5]  # mean of a and b
    assert list(by_label["phases"].get_xdata()) == [4, 8]  # no step losses: its round means, at the round's end
    assert list(by_label["phases"].get_ydata()) == [2.0, 3.0]
    local, = phase_axis.get_lines()
    assert local.get_label() == "phases: local phase" and list(local.get_ydata()) == [6.0, 11.0]
    assert {line.get_label() for line in test_axis.get_lines()} == {"pretrained", "steps", "phases"}
    plt.close("all")


def test_every_communication_bar_carries_its_value(tmp_path, monkeypatch):
    figures = _drawn(monkeypatch)
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


def test_a_plugin_familys_reporter_adds_its_values_fields_rows_and_section(tmp_path, monkeypatch):
    """A method of a plug-in brings its own figures through MethodSpec(reporter=...): the registry lists
    the reporter once, the summary keeps its value and field, the report prints its section."""
    from ondevice_moe.methods.registry import METHODS, reporters
    from ondevice_moe.methods.spec import MethodSpec
    from ondevice_moe.report.reporter import Reporter

    class Widest(Reporter):
        value_keys = MappingProxyType({"score_spread": "spread"})

        def entry_fields(self, final, users):
            return {"widest": max(final[u]["score_spread"] for u in users)} if "score_spread" in final[users[0]] else {}

        def sections(self, summary):
            return [f"widest spread: {m['widest']}" for m in summary["methods"].values() if "widest" in m]

    widest = Widest()
    fedavg = METHODS["fedavg"]
    monkeypatch.setitem(METHODS, "spread-a", MethodSpec(fedavg.options, fedavg.build, reporter=widest))
    monkeypatch.setitem(METHODS, "spread-b", MethodSpec(fedavg.options, fedavg.build, reporter=widest))
    families = reporters()
    assert [r for r in families if r is widest] == [widest]
    records = [{"method": "spread-a", "round": 1, "kind": "eval", "user": user, "score": score, "score_spread": spread}
               for user, score, spread in (("a", 60.0, 3.0), ("b", 70.0, 5.0))]
    summary = report.summarize(records, ["spread-a"], ["a", "b"], metric="accuracy", reporters=families)
    entry = summary["methods"]["spread-a"]
    assert entry["mean_spread"] == 4.0 and entry["widest"] == 5.0 and entry["per_user"]["b"]["spread"] == 5.0
    assert "widest spread: 5.0" in report.write_report(tmp_path, "r", summary, [], reporters=families).read_text()
    plain = report.summarize(records, ["spread-a"], ["a", "b"], metric="accuracy")
    assert "widest" not in plain["methods"]["spread-a"] and "mean_spread" not in plain["methods"]["spread-a"]
