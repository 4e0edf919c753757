"""eval/seed_table.py: the table over seeds and the paired comparison."""

import importlib.util
import math
import random
from pathlib import Path

import pytest
from scipy import stats

PATH = Path(__file__).parent.parent / "eval" / "seed_table.py"
SPEC = importlib.util.spec_from_file_location("seed_table", PATH)
seed_table = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(seed_table)

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
    mean, error, t_p, wilcoxon_p = seed_table.paired_test(differences)
    assert mean == pytest.approx(1.45)
    assert error == pytest.approx(stats.tstd(differences) / math.sqrt(6))
    assert t_p == pytest.approx(stats.ttest_rel(differences, [0.0] * 6).pvalue)
    assert wilcoxon_p == pytest.approx(stats.wilcoxon(differences).pvalue)


def test_paired_table_tells_a_consistent_gap_from_noise():
    summaries = [_summary(seed) for seed in range(3)]
    table = seed_table.paired_table(summaries, "base")
    better = next(line for line in table.splitlines() if line.startswith("| better |"))
    same = next(line for line in table.splitlines() if line.startswith("| same |"))
    gaps = seed_table.paired_differences(summaries, "better", "base", "in")
    expected = [100 * math.log(s["methods"]["better"]["per_user"][u]["in"] / s["methods"]["base"]["per_user"][u]["in"])
                for s in summaries for u in USERS]
    assert gaps == pytest.approx(expected) and all(-4 < g < -1.5 for g in gaps)  # 1 in 30-45: -2 to -3 %
    assert f"| {sum(expected) / 12:+.2f} (" in better and better.endswith("| yes |") and "| 12 |" in better
    assert same.endswith("| no |")


def test_paired_table_names_a_missing_reference():
    with pytest.raises(SystemExit, match="not in every run"):
        seed_table.paired_table([_summary(0)], "fedavg")


def test_folders_of_one_seed_joined_with_plus_stand_side_by_side(tmp_path):
    import json

    full = _summary(0)
    first, second = tmp_path / "base", tmp_path / "more"
    for folder, names in ((first, ["base", "better"]), (second, ["same"])):
        folder.mkdir()
        part = {**full, "methods": {name: full["methods"][name] for name in names}}
        (folder / "summary.json").write_text(json.dumps(part))
    [joined] = seed_table.load_summaries([Path(f"{first}+{second}")])
    assert list(joined["methods"]) == ["base", "better", "same"]
    assert joined["methods"]["same"] == full["methods"]["same"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "summary.json").write_text(json.dumps({**full, "users": ["x"]}))
    with pytest.raises(SystemExit, match="different users"):
        seed_table.load_summaries([Path(f"{first}+{other}")])


def test_centres_are_matched_to_sources_before_they_are_averaged_over_runs():
    """Run 0 learned source 0 in centre 0, run 1 in centre 1: matched, both runs agree."""
    runs = [{"c0s0": 10.0, "c0s1": 90.0, "c1s0": 80.0, "c1s1": 20.0},
            {"c0s0": 70.0, "c0s1": 30.0, "c1s0": 12.0, "c1s1": 60.0}]
    summaries = [{"users": USERS, "metric": "mse", "methods": {"fedsoft": {
        "centres": {f"centre_{k[1]}_source_{k[3]}": v for k, v in run.items()}}}} for run in runs]
    assert seed_table.matched_centres(summaries[1]["methods"]["fedsoft"]["centres"], True) == [[12.0, 70.0],
                                                                                              [60.0, 30.0]]
    table = seed_table.centre_table(summaries).splitlines()
    assert table[2] == "| fedsoft | θ_0 | 11.00 (1.41) | 75.00 (7.07) | 2 of 2 |"
    assert table[3] == "| fedsoft | θ_1 | 25.00 (7.07) | 75.00 (21.21) | 2 of 2 |"


def test_personalisation_table_averages_flow_columns_over_runs():
    columns = seed_table.PERSONALISATION_COLUMNS.values()
    runs = [{"users": ["a"], "methods": {"flow": {key: base + offset for offset, key in enumerate(columns)},
                                         "fedavg": {"mean_score": 50.0}}} for base in (10.0, 20.0)]
    lines = seed_table.personalisation_table(runs).splitlines()
    assert len(lines) == 3  # header, rule, flow (fedavg has no global/personalised pair)
    assert lines[2] == "| flow | " + " | ".join(f"{15.0 + i:.2f} (7.07)" for i in range(len(columns))) + " |"
