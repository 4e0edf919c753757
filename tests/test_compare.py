"""ondevice_moe.compare (`ondevice-moe compare`): the table over seeds and the paired comparison."""

import json
import math
import random
import statistics
from pathlib import Path

import pytest
from scipy import stats
from typer.testing import CliRunner

from ondevice_moe import compare
from ondevice_moe.cli import app
from ondevice_moe.errors import UserError
from ondevice_moe.methods.fedsoft import report as centres_report
from ondevice_moe.methods.flow import report as personalisation_report
from ondevice_moe.report import MetricsLog, summarize

USERS = ["a", "b", "c", "d"]


def _summary(seed: int) -> dict:
    """Three methods: 'better' is 'base' minus 1 with small noise, 'same' is 'base' plus symmetric noise."""
    rng = random.Random(seed)
    base = {u: 30.0 + 5 * i + rng.gauss(0, 2) for i, u in enumerate(USERS)}
    values = {"base": base,
              "better": {u: v - 1.0 + rng.gauss(0, 0.1) for u, v in base.items()},
              "same": {u: v + rng.choice([-1, 1]) * rng.uniform(0.5, 1.5) for u, v in base.items()}}
    methods = {}
    for name, per_user in values.items():
        mean = sum(per_user.values()) / len(USERS)
        methods[name] = {"per_user": {u: {"in": v, "out": v} for u, v in per_user.items()},
                         "mean_in": mean, "std_in": 0.0, "mean_out": mean, "std_out": 0.0,
                         "upload_bytes_per_round": 0.0}
    return {"users": USERS, "methods": methods}


def test_paired_test_matches_scipy():
    differences = [1.0, 2.0, 1.5, 2.5, 0.5, 1.2]
    mean, error, t_p, wilcoxon_p = compare.paired_test(differences)
    assert mean == pytest.approx(1.45)
    assert error == pytest.approx(stats.tstd(differences) / math.sqrt(6))
    assert t_p == pytest.approx(stats.ttest_rel(differences, [0.0] * 6).pvalue)
    assert wilcoxon_p == pytest.approx(stats.wilcoxon(differences).pvalue)


def test_paired_table_tells_a_consistent_gap_from_noise():
    summaries = [_summary(seed) for seed in range(3)]
    table = compare.paired_table(summaries, "base")
    better = next(line for line in table.splitlines() if line.startswith("| better |"))
    same = next(line for line in table.splitlines() if line.startswith("| same |"))
    gaps = compare.paired_differences(summaries, "better", "base", "in")
    expected = [100 * math.log(s["methods"]["better"]["per_user"][u]["in"] / s["methods"]["base"]["per_user"][u]["in"])
                for s in summaries for u in USERS]
    assert gaps == pytest.approx(expected) and all(-4 < g < -1.5 for g in gaps)  # 1 in 30-45: -2 to -3 %
    seeds = [statistics.fmean(expected[4 * run:4 * run + 4]) for run in range(3)]  # the unit: a run's mean gap
    assert compare.seed_differences(summaries, "better", "base", "in") == pytest.approx(seeds)
    assert f"| {statistics.fmean(seeds):+.2f} (" in better and "| yes |" in better and "| 3 |" in better
    assert better.endswith(f", {len(expected)} |")  # the (run, user) pairs, as description
    assert "| no |" in same
    assert "n = 3 run(s)" in table and "cannot reach 0.05 below 6 runs" in table


def test_the_test_is_at_the_seed_where_clients_of_one_seed_would_look_significant():
    """Users of one run share its model and data: three seeds whose users all move together give 30
    (run, user) pairs that a client-level test calls significant, and three runs that say nothing."""
    users = [f"u{i}" for i in range(10)]
    effects = [-2.0, -2.2, 0.5]  # each seed's own shift, every user of it alike (in %)
    rng = random.Random(3)
    summaries = []
    for seed, effect in enumerate(effects):
        base = {u: 30.0 + i for i, u in enumerate(users)}
        moved = {u: v * math.exp((effect + rng.gauss(0, 0.05)) / 100) for u, v in base.items()}
        methods = {name: {"per_user": {u: {"in": v} for u, v in values.items()},
                          "mean_in": statistics.fmean(values.values()), "std_in": 0.0}
                   for name, values in (("base", base), ("moved", moved))}
        summaries.append({"users": users, "methods": methods, "split_seed": seed})
    pairs = compare.paired_differences(summaries, "moved", "base", "in")
    assert len(pairs) == 30 and compare.paired_test(pairs)[2] < 1e-3  # as if every client were independent
    row = next(line for line in compare.paired_table(summaries, "base").splitlines() if line.startswith("| moved |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[3] == "3" and float(cells[4]) > 0.05 and cells[6] == "no" and cells[7].endswith(", 30")
    shared = [{**summary, "split_seed": 0} for summary in summaries]
    assert "share one data partition (data_seed 0)" in compare.unit_note(shared)
    assert "share one data partition" not in compare.unit_note(summaries)


def test_a_familys_compared_values_are_tested_where_both_methods_hold_them():
    """FedSoft's w̄ on training data (``score_train``) is tested beside the test score where both methods
    have it, as an absolute gap in points; a method without it is tested on the score only."""
    def entry(scores: dict[str, float], train: dict[str, float] | None) -> dict:
        per_user = {u: {"score": scores[u], **({"score_train": train[u]} if train else {})} for u in USERS}
        means = {"mean_score": statistics.fmean(scores.values()), "std_score": 0.0}
        if train:
            means |= {"mean_score_train": statistics.fmean(train.values()), "std_score_train": 0.0}
        return {"per_user": per_user, **means, "upload_bytes_per_round": 0.0}

    summaries = []
    for seed in range(3):
        test = {u: 70.0 + i + seed for i, u in enumerate(USERS)}
        summaries.append({"users": USERS, "metric": "accuracy", "methods": {
            "ifca": entry(test, {u: v + 20 for u, v in test.items()}),
            "fedsoft": entry({u: v - 2 for u, v in test.items()}, {u: v + 23 for u, v in test.items()}),
            "fedavg": entry(test, None)}})
    rows = [line for line in compare.paired_table(summaries, "ifca").splitlines() if line.startswith("| fed")]
    assert [row.split(" | ")[:2] for row in rows] == [["| fedsoft", "score"], ["| fedsoft", "score_train"],
                                                      ["| fedavg", "score"]]
    assert "| -2.00 (0.00) |" in rows[0] and "| +3.00 (0.00) |" in rows[1]


def test_paired_table_names_a_missing_reference():
    with pytest.raises(UserError, match="not in every run"):
        compare.paired_table([_summary(0)], "fedavg")


def test_folders_of_one_seed_joined_with_plus_stand_side_by_side(tmp_path):
    full = _summary(0)
    first, second = tmp_path / "base", tmp_path / "more"
    for folder, names in ((first, ["base", "better"]), (second, ["same"])):
        folder.mkdir()
        part = {**full, "methods": {name: full["methods"][name] for name in names}}
        (folder / "summary.json").write_text(json.dumps(part))
    [joined] = compare.load_summaries([Path(f"{first}+{second}")])
    assert list(joined["methods"]) == ["base", "better", "same"]
    assert joined["methods"]["same"] == full["methods"]["same"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "summary.json").write_text(json.dumps({**full, "users": ["x"]}))
    with pytest.raises(UserError, match="different users"):
        compare.load_summaries([Path(f"{first}+{other}")])


def test_one_method_name_in_two_joined_folders_comes_from_the_first_or_from_both_with_a_label(tmp_path):
    summaries = {name: _summary(seed) for seed, name in enumerate(("five-steps", "more-steps"))}
    for name, summary in summaries.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    first, second = tmp_path / "five-steps", tmp_path / "more-steps"
    [joined] = compare.load_summaries([Path(f"{first}+{second}")])
    assert joined["methods"] == summaries["five-steps"]["methods"]
    text = compare.comparison([Path(f"{first}+{second}")])
    assert f"base: from {first}; its copy in {second} is left out" in text
    [labelled] = compare.load_summaries([Path(f"{first}+{second}@long")])
    assert list(labelled["methods"]) == ["base", "better", "same", "base@long", "better@long", "same@long"]
    assert labelled["methods"]["base@long"] == summaries["more-steps"]["methods"]["base"]
    assert "left out" not in compare.comparison([Path(f"{first}+{second}@long")])
    assert compare.paired_differences([labelled], "base@long", "base", "in") == pytest.approx(
        [100 * math.log(summaries["more-steps"]["methods"]["base"]["per_user"][u]["in"]
                        / summaries["five-steps"]["methods"]["base"]["per_user"][u]["in"]) for u in USERS])
    at_sign = tmp_path / "run@s0"  # a folder whose own name holds '@' is read as it is
    at_sign.mkdir()
    (at_sign / "summary.json").write_text(json.dumps(summaries["more-steps"]))
    [plain] = compare.load_summaries([at_sign])
    assert list(plain["methods"]) == ["base", "better", "same"]


def test_centres_are_matched_to_sources_before_they_are_averaged_over_runs():
    """Run 0 learned source 0 in centre 0, run 1 in centre 1: matched, both runs agree."""
    runs = [{"c0s0": 10.0, "c0s1": 90.0, "c1s0": 80.0, "c1s1": 20.0},
            {"c0s0": 70.0, "c0s1": 30.0, "c1s0": 12.0, "c1s1": 60.0}]
    summaries = [{"users": USERS, "metric": "mse", "methods": {"fedsoft": {
        "centres": {f"centre_{k[1]}_source_{k[3]}": v for k, v in run.items()}}}} for run in runs]
    assert centres_report.matched_centres(summaries[1]["methods"]["fedsoft"]["centres"], True) == [[12.0, 70.0],
                                                                                              [60.0, 30.0]]
    table = centres_report.compared_centres(summaries).splitlines()
    assert table[2] == "| fedsoft | θ_0 | 11.00 (1.41) | 75.00 (7.07) | 2 of 2 |"
    assert table[3] == "| fedsoft | θ_1 | 25.00 (7.07) | 75.00 (21.21) | 2 of 2 |"


def test_personalisation_table_averages_flow_columns_over_runs():
    columns = personalisation_report.PERSONALISATION_COLUMNS.values()
    runs = [{"users": ["a"], "methods": {"flow": {key: base + offset for offset, key in enumerate(columns)},
                                         "fedavg": {"mean_score": 50.0}}} for base in (10.0, 20.0)]
    lines = personalisation_report.personalisation_table(runs).splitlines()
    assert len(lines) == 3  # header, rule, flow (fedavg has no global/personalised pair)
    assert lines[2] == "| flow | " + " | ".join(f"{15.0 + i:.2f} (7.07)" for i in range(len(columns))) + " |"


def _write_run(folder: Path, summary: dict) -> Path:
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_the_command_prints_the_mean_over_runs_and_the_paired_test_as_computed_by_hand(tmp_path):
    per_run = [  # run → method → user → test perplexity in distribution
        {"base": {"a": 20.0, "b": 40.0}, "better": {"a": 19.0, "b": 37.0}},
        {"base": {"a": 22.0, "b": 41.0}, "better": {"a": 20.5, "b": 39.0}},
        {"base": {"a": 21.0, "b": 39.0}, "better": {"a": 20.0, "b": 36.5}},
    ]
    folders = []
    for index, methods in enumerate(per_run):
        entries = {name: {"per_user": {u: {"in": v} for u, v in values.items()},
                          "mean_in": statistics.fmean(values.values()),
                          "std_in": statistics.pstdev(values.values()), "upload_bytes_per_round": 2048.0 * index}
                   for name, values in methods.items()}
        folders.append(str(_write_run(tmp_path / f"s{index}", {"users": ["a", "b"], "methods": entries})))
    result = CliRunner().invoke(app, ["compare", *folders, "--against", "base"])
    assert result.exit_code == 0, result.output
    means = [statistics.fmean(run["better"].values()) for run in per_run]  # 28.0, 29.75, 28.25
    assert f"| better | {statistics.fmean(means):.2f} ({statistics.stdev(means):.2f}) |" in result.output
    assert "| 2.0 KiB |" in result.output.split("| better |")[1].splitlines()[0]  # upload: mean of 0, 2, 4 KiB
    gaps = [statistics.fmean(100 * math.log(run["better"][u] / run["base"][u]) for u in ("a", "b"))
            for run in per_run]  # per run (seed), its users' mean gap
    row = next(line for line in result.output.splitlines() if line.startswith("| better | in |"))
    t_p = stats.ttest_1samp(gaps, 0.0).pvalue
    error = statistics.stdev(gaps) / math.sqrt(len(gaps))
    assert row.startswith(f"| better | in | {statistics.fmean(gaps):+.2f} ({error:.2f}) | 3 | {t_p:.3g} |")
    assert "n = 3 run(s)" in " ".join(result.output.split())


@pytest.mark.parametrize(("content", "problem"), [
    ("{not json", "cannot read"),
    ("[1, 2]", "not a JSON object"),
    ('{"users": ["a"], "methods": {"m": {"per_user": {"a": {"in": "12"}}}}}', "neither a number nor null"),
    ('{"users": ["a"], "methods": {"m": {"centres": {"../x": 1.0}}}}', "names a centre"),
    (None, "does not exist"),
])
def test_a_damaged_or_missing_summary_is_one_clear_error(tmp_path, content, problem):
    folder = tmp_path / "run"
    folder.mkdir()
    if content is not None:
        (folder / "summary.json").write_text(content)
    result = CliRunner().invoke(app, ["compare", str(folder)])
    assert result.exit_code == 2 and problem in " ".join(result.output.split())
    assert "fix:" in result.output and "Traceback" not in result.output


def _write_logged_run(folder: Path, scores: dict[str, dict[int, dict[str, float]]]) -> Path:
    """A run folder as finetune leaves it: ``metrics.jsonl`` with each round's uploads and the
    evaluations ``scores`` (method → round → user → score), and the summary.json it summarises to."""
    log = MetricsLog(folder / "metrics.jsonl")
    for method, by_round in scores.items():
        for server_round in range(1, max(by_round) + 1):
            log.write({"method": method, "kind": "comm", "round": server_round, "bytes_up": 1024 * server_round,
                       "bytes_down": 0})
            for user, score in by_round.get(server_round, {}).items():
                log.write({"method": method, "kind": "eval", "round": server_round, "user": user, "score": score})
    users = sorted({user for by_round in scores.values() for values in by_round.values() for user in values})
    summary = summarize(log.read(), list(scores), users, "accuracy")
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_per_round_tables_follow_the_training_as_the_logged_evaluations_give_it(tmp_path):
    lifts = (2.0, 3.0, 2.5)  # 'faster' leads by about this after round 1, and both end level after round 2
    runs = []
    for seed, lift in enumerate(lifts):
        first, last = {"a": 60.0 + seed, "b": 70.0 + seed}, {"a": 80.0 + seed, "b": 90.0 + seed}
        ahead = {"a": first["a"] + lift, "b": first["b"] + lift + 0.1}
        base = _write_logged_run(tmp_path / f"base-s{seed}", {"base": {1: first, 2: last}})
        faster = _write_logged_run(tmp_path / f"faster-s{seed}", {"base": {1: ahead, 2: last}})
        runs.append(f"{base}+{faster}@faster")
    result = CliRunner().invoke(app, ["compare", *runs, "--against", "base", "--per-round"])
    assert result.exit_code == 0, result.output
    values, gaps = result.output.split("Per round: mean (std)")[1].split("Per round: mean Δ")
    after_one = [65.05 + seed + lift for seed, lift in enumerate(lifts)]  # the users' mean, per seed
    assert (f"| base@faster | score | {statistics.fmean(after_one):.2f} ({statistics.stdev(after_one):.2f}) | "
            "86.00 (1.00) |") in values
    assert "| base | score | 66.00 (1.00) | 86.00 (1.00) |" in values
    differences = [lift + 0.05 for lift in lifts]  # per run (seed): its two users' mean gap
    error = statistics.stdev(differences) / math.sqrt(len(differences))
    t_p, wilcoxon_p = stats.ttest_1samp(differences, 0.0).pvalue, stats.wilcoxon(differences).pvalue
    assert t_p < 0.05 < wilcoxon_p  # three runs: the t-test decides, the Wilcoxon test cannot reach 0.05
    assert (f"| base@faster | score | **{statistics.fmean(differences):+.2f} ({error:.2f})**, {t_p:.2g} / "
            f"{wilcoxon_p:.2g} | +0.00 (0.00), nan / nan |") in gaps


def test_a_round_one_method_was_not_evaluated_in_shows_a_dash_and_rounds_not_in_every_run_are_left_out(tmp_path):
    every = _write_logged_run(tmp_path / "s0", {"base": {1: {"a": 50.0}, 2: {"a": 60.0}, 3: {"a": 70.0}},
                                                "late": {3: {"a": 65.0}}})
    fewer = _write_logged_run(tmp_path / "s1", {"base": {2: {"a": 61.0}, 3: {"a": 71.0}},
                                                "late": {3: {"a": 66.0}}})
    assert compare.evaluated_rounds([every, fewer]) == [2, 3]
    text = compare.comparison([every, fewer], "base", per_round=True)
    values = text.split("Per round: mean (std)")[1].split("Per round: mean Δ")[0]
    assert "| base | score | round 2 | round 3 |" not in values and "| method | value | round 2 | round 3 |" in values
    assert "| late | score | – | 65.50 (0.71) |" in values
    assert "| late | score | – | -5.00 (0.00), nan / nan |" in text


@pytest.mark.parametrize(("log", "problem"), [
    (None, "metrics.jsonl does not exist"),
    ('{"kind": "eval"}\n', "is not a metrics record"),
    ('{"method": "base", "kind": "comm", "round": 1}\n{"method": "base", "kind": "eval", "round": 1, "user": "a", '
     '"score": 50.0}\n', "a record unlike those finetune writes"),
    ('{"method": "base", "kind": "eval", "round": 1, "user": "a", "score": "high"}\n',
     "a record unlike those finetune writes"),
])
def test_a_damaged_or_missing_log_is_one_clear_error_per_round_only(tmp_path, log, problem):
    run = _write_logged_run(tmp_path / "run", {"base": {1: {"a": 50.0}}})
    if log is None:
        (run / "metrics.jsonl").unlink()
    else:
        (run / "metrics.jsonl").write_text(log)
    assert CliRunner().invoke(app, ["compare", str(run)]).exit_code == 0  # the final tables need no log
    result = CliRunner().invoke(app, ["compare", str(run), "--per-round"])
    assert result.exit_code == 2 and problem in " ".join(result.output.split()), result.output
    assert "fix:" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("metric", "unit"), [("accuracy", "Δ points"), ("mse", "Δ MSE"), ("perplexity", "Δ%")])
def test_the_gap_names_its_unit_points_for_scaled_scores_the_error_itself_for_mse(metric, unit):
    """Accuracy and the other scores are scaled ×100, so their gaps are points; an MSE is left as it is,
    so its gap is an MSE (FLoRAL's synthetic tasks); perplexities are compared in percent."""
    def entry(value: float) -> dict:
        key = "in" if metric == "perplexity" else "score"
        values = {u: {key: value + i, **({"out": value} if key == "in" else {})} for i, u in enumerate(USERS)}
        means = {"mean_in": value, "mean_out": value} if key == "in" else {"mean_score": value}
        return {"per_user": values, **means, "upload_bytes_per_round": 0.0}

    summaries = [{"users": USERS, "metric": metric, "methods": {"a": entry(2.0 + seed), "b": entry(1.0 + seed)}}
                 for seed in range(3)]
    header = next(line for line in compare.paired_table(summaries, "a").splitlines() if line.startswith("| method"))
    assert f"mean {unit} vs a (s.e.)" in header
