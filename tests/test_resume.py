"""Honest resume: a run killed at any point and rerun ends as if never interrupted;
run folders that cannot be used end in one clear UserError."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ondevice_moe import folder_lock, runner
from ondevice_moe.errors import UserError
from ondevice_moe.recipe import load_recipe
from ondevice_moe.report import MetricsLog
from ondevice_moe.run_folder import LOCK, RunFolder, RunResult, run_lock

ROOT = Path(__file__).parent.parent
TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
CLI = Path(sys.executable).parent / "ondevice-moe"


def trimmed_recipe(path: Path) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    raw["methods"] = ["pretrained", "fedavg"]  # 4 + 17 metrics lines
    path.write_text(yaml.safe_dump(raw))
    return path


def finetune(recipe: Path, output: Path, kill_at_line: int | None = None) -> subprocess.CompletedProcess | int:
    """Run the CLI; with ``kill_at_line``, SIGKILL it once metrics.jsonl has that many lines."""
    command = [str(CLI), "finetune", str(recipe), "--output", str(output)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    if kill_at_line is None:
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    log = output / "metrics.jsonl"
    while process.poll() is None:
        if log.exists() and log.read_text().count("\n") >= kill_at_line:
            os.killpg(process.pid, signal.SIGKILL)  # the CLI and the Ray workers it started
            break
        time.sleep(0.02)
    return process.wait()


def results_of(run_dir: Path) -> dict:
    """A run's summary.json without its rounds' timings, which differ from run to run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.pop("round_overhead")
    return summary


@pytest.mark.slow
def test_killed_runs_resume_to_the_same_summary(tmp_path):
    recipe = trimmed_recipe(tmp_path / "trimmed.yaml")
    reference = finetune(recipe, tmp_path / "reference")
    assert reference.returncode == 0, reference.stdout + reference.stderr
    expected = results_of(tmp_path / "reference")

    resumed = tmp_path / "resumed"
    # Mid round 1 of fedavg (pretrained finished), then during its final evaluation (devices writing checkpoints).
    # Killing between the last eval line and `done` cannot be timed from outside (they are written together):
    # test_method_without_done_record_runs_again covers that state.
    for kill_at in (6, 16):
        assert finetune(recipe, resumed, kill_at) == -signal.SIGKILL
        assert "fedavg" not in MetricsLog(resumed / "metrics.jsonl").finished()
    final = finetune(recipe, resumed)
    assert final.returncode == 0, final.stdout + final.stderr
    assert results_of(resumed) == expected
    records = MetricsLog(resumed / "metrics.jsonl").read()
    assert [r["kind"] for r in records].count("done") == 2
    assert (resumed / "checkpoints" / "fedavg" / "device_2.safetensors").exists()


def start_long_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """The CLI on the tiny recipe's pretrained and FedAvg with far more rounds than a test waits for, in a
    session of its own, its output piped; returns the process and its run folder."""
    raw = yaml.safe_load(TINY.read_text())
    raw["methods"], raw["federation"]["rounds"] = ["pretrained", "fedavg"], 1000
    recipe = tmp_path / "long.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    output = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FLWR_TELEMETRY_ENABLED": "0", "COLUMNS": "300"}
    process = subprocess.Popen([str(CLI), "finetune", str(recipe), "--output", str(output)], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return process, output


@pytest.mark.slow
def test_ctrl_c_stops_the_run_after_the_round_in_progress_and_says_how_to_resume(tmp_path):
    process, output = start_long_run(tmp_path)
    rounds = []
    while len(rounds) < 2 and process.poll() is None:
        time.sleep(0.1)
        if (output / "metrics.jsonl").exists():
            rounds = [r for r in MetricsLog(output / "metrics.jsonl").read() if r["kind"] == "round"]
    os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the CLI and its Ray workers
    seen, _ = process.communicate(timeout=120)
    seen = " ".join(seen.split())
    assert process.returncode == 130, seen
    records = MetricsLog(output / "metrics.jsonl").read()
    last = max(r["round"] for r in records if r["kind"] == "round")
    assert f"stopped on request during 'fedavg' after round {last}" in seen and last < 1000
    assert "run the same command again to resume" in seen and "Traceback" not in seen
    assert MetricsLog(output / "metrics.jsonl").finished() == {"pretrained"} and (output / "report.md").is_file()


def _session_members(session: int) -> list[int]:
    """The live (not zombie) processes of a session, read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_leaves_no_ray_process_behind(tmp_path, own_ray):
    process, output = start_long_run(tmp_path)
    try:
        while process.poll() is None and not ((output / "metrics.jsonl").exists()
                                              and (output / "metrics.jsonl").read_text().count("\n") >= 1):
            time.sleep(0.1)
        assert len(_session_members(process.pid)) > 1, "Ray's processes run beside the CLI"
        for _ in range(2):  # as `kill -INT PID` twice: to the CLI alone, not to its process group
            process.send_signal(signal.SIGINT)
            time.sleep(0.5)
        seen, _ = process.communicate(timeout=60)
        assert process.returncode == 130 and "stopped now" in seen, seen
        deadline = time.monotonic() + 10
        while _session_members(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _session_members(process.pid) == [], "a process the run started outlived it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def test_a_killed_runs_children_do_not_hold_its_folder(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", (  # a run holding the folder, with a child that outlives it
        "import subprocess, time; from pathlib import Path; from ondevice_moe.run_folder import run_lock\n"
        f"with run_lock(Path({str(run_dir)!r})):\n"
        "    child = subprocess.Popen(['sleep', '60'])\n    print(child.pid, flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        assert folder_lock.live_holder(run_dir / LOCK) == {"pid": holder.pid}
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        assert Path(f"/proc/{child}").exists()  # the child lives on
        assert folder_lock.live_holder(run_dir / LOCK) is None  # and holds nothing
        with run_lock(run_dir):
            pass
    finally:
        os.kill(child, signal.SIGKILL)


def test_method_without_done_record_runs_again(tmp_path, monkeypatch):
    recipe = load_recipe(TINY)
    run_dir = RunFolder(recipe, tmp_path / "run").prepare()
    log = MetricsLog(run_dir / "metrics.jsonl")
    for user in recipe.user_names:  # final evaluation logged, killed before the done record
        log.write({"method": "pretrained", "round": 0, "kind": "eval", "user": user, "test_ppl_in": 9.0,
                   "test_ppl_out": 9.0})
    simulated = []
    monkeypatch.setattr(runner, "check_inputs", lambda _: None)
    monkeypatch.setattr(runner, "_simulate", lambda jobs, *_: simulated.append([job.method.name for job in jobs]))
    with pytest.raises(UserError, match="method 'pretrained' did not finish"):
        runner.run_recipe(recipe, run_dir)
    assert simulated == [["pretrained", "fedavg", "comigs-1G1S"]]  # one simulation; a stub that runs nothing
    assert not [r for r in log.read() if r["kind"] == "eval"]  # the partial attempt was discarded


def test_line_cut_short_by_a_kill_is_repaired(tmp_path):
    recipe = load_recipe(TINY)
    run_dir = RunFolder(recipe, tmp_path / "run").prepare()
    (run_dir / "metrics.jsonl").write_text('{"kind": "done", "method": "pretrained", "rounds": 0}\n{"kind": "ev')
    RunFolder(recipe, run_dir).prepare()
    assert (run_dir / "metrics.jsonl").read_text() == '{"kind": "done", "method": "pretrained", "rounds": 0}\n'


@pytest.mark.parametrize("damage", ["file", "garbage-log", "binary-recipe", "recipe-is-a-folder"])
def test_unusable_run_folder_is_one_user_error(tmp_path, damage):
    recipe = load_recipe(TINY)
    run_dir = tmp_path / "run"
    if damage == "file":
        run_dir.write_text("not a folder")
    else:
        RunFolder(recipe, run_dir).prepare()
    if damage == "garbage-log":
        (run_dir / "metrics.jsonl").write_text('{"kind": "done", "method": "x"}\n\x00garbage\n{"kind": "done"}\n')
    if damage == "binary-recipe":
        (run_dir / "recipe.yaml").write_bytes(b"\xff\xfe\x00binary")
    if damage == "recipe-is-a-folder":
        (run_dir / "recipe.yaml").unlink()
        (run_dir / "recipe.yaml").mkdir()
    with pytest.raises(UserError) as error:
        RunFolder(recipe, run_dir).prepare()
    assert str(run_dir) in error.value.problem
    assert error.value.fix


def test_a_second_run_into_a_folder_in_use_is_refused_and_a_dead_owners_lock_taken_over(tmp_path, monkeypatch):
    recipe = load_recipe(TINY)
    run_dir = RunFolder(recipe, tmp_path / "run").prepare()
    monkeypatch.setattr(runner, "check_inputs", lambda _: None)
    simulated = []
    monkeypatch.setattr(runner, "_simulate", lambda jobs, *_: simulated.extend(job.method.name for job in jobs))
    holder = subprocess.Popen([sys.executable, "-c", (  # a live run holding the folder
        "import time; from pathlib import Path; from ondevice_moe.run_folder import run_lock\n"
        f"with run_lock(Path({str(run_dir)!r})):\n    print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(UserError, match=f"another ondevice-moe run \\(pid {holder.pid}\\) is writing"):
        runner.run_recipe(recipe, run_dir)
    assert simulated == []
    os.kill(holder.pid, signal.SIGKILL)  # killed: a zombie until reaped, its pid still taken
    while (Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
           or len(os.listdir(f"/proc/{holder.pid}/task")) > 1):  # every thread gone, the process not yet reaped
        time.sleep(0.05)
    (run_dir / LOCK).write_text(json.dumps({"pid": os.getpid()}))  # even naming a live pid holds nothing
    with pytest.raises(UserError, match="did not finish"):  # the stub trains nothing, but the run went ahead
        runner.run_recipe(recipe, run_dir)
    holder.wait()
    assert simulated == ["pretrained", "fedavg", "comigs-1G1S"] and (run_dir / LOCK).read_text() == ""


def test_a_folder_where_nothing_ran_takes_the_corrected_recipe(tmp_path):
    recipe = load_recipe(TINY)
    run_dir = RunFolder(recipe, tmp_path / "run").prepare()  # then its inputs failed: nothing ran
    corrected = recipe.model_copy(update={"seed": recipe.seed + 1})
    assert RunFolder(corrected, run_dir).prepare() == run_dir
    MetricsLog(run_dir / "metrics.jsonl").write({"method": "pretrained", "kind": "done", "rounds": 0})
    with pytest.raises(UserError, match="different recipe"):  # once something ran, the folder is that run's
        RunFolder(recipe, run_dir).prepare()


def test_a_run_resumes_after_its_recipes_description_was_edited(tmp_path):
    """The description documents a run and changes nothing it computes: editing it (a wall time added,
    say) keeps the folder's finished methods; any other edit is another recipe."""
    recipe = load_recipe(TINY)
    run_dir = RunFolder(recipe, tmp_path / "run").prepare()
    MetricsLog(run_dir / "metrics.jsonl").write({"method": "pretrained", "kind": "done", "rounds": 0})
    redescribed = recipe.model_copy(update={"description": recipe.description + " Takes 2 min on 2 cores."})
    assert RunFolder(redescribed, run_dir).kept() == {"pretrained"}
    with pytest.raises(UserError, match="different recipe"):
        RunFolder(redescribed.model_copy(update={"name": recipe.name + "-renamed"}), run_dir).kept()


def test_a_run_folder_of_an_earlier_version_resumes_when_only_keys_added_since_differ(tmp_path):
    """A run started before a key existed wrote no such key: with the key at its default it is the same
    run, and resumes; a value that differs is another recipe still, and so is a file that is no recipe."""
    recipe = load_recipe(TINY)
    run_dir = RunFolder(recipe, tmp_path / "run").prepare()
    MetricsLog(run_dir / "metrics.jsonl").write({"method": "pretrained", "kind": "done", "rounds": 0})
    earlier = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    del earlier["logging"], earlier["privacy"]["delta"]  # keys of issue 35, at their defaults
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(earlier, sort_keys=False))
    assert RunFolder(recipe, run_dir).kept() == {"pretrained"}
    with pytest.raises(UserError, match="different recipe"):
        RunFolder(recipe.model_copy(update={"seed": recipe.seed + 1}), run_dir).kept()
    for text in ("- not\n- a recipe\n", "name: [unclosed\n", "name: x\nnot_a_key: 1\n"):
        (run_dir / "recipe.yaml").write_text(text)
        with pytest.raises(UserError, match="different recipe"):
            RunFolder(recipe, run_dir).kept()


def test_rerunning_a_finished_run_loads_no_model_or_data(tmp_path, monkeypatch):
    recipe = load_recipe(TINY)
    run_dir = RunFolder(recipe, tmp_path / "run").prepare()
    log = MetricsLog(run_dir / "metrics.jsonl")
    for index in range(len(recipe.methods)):
        for user in recipe.user_names:
            log.write({"method": recipe.method_name(index), "round": 2, "kind": "eval", "user": user,
                       "test_ppl_in": 9.0, "test_ppl_out": 9.0})
        log.write({"method": recipe.method_name(index), "kind": "done", "rounds": 2})

    def must_not_load(_):
        raise AssertionError("a finished run loaded its inputs again")

    monkeypatch.setattr(runner, "check_inputs", must_not_load)
    result = runner.run_recipe(recipe, run_dir)
    assert set(result.summary["methods"]) == {recipe.method_name(i) for i in range(len(recipe.methods))}


def test_a_simulation_that_ends_early_gives_its_method_an_error_and_the_unstarted_ones_a_new_simulation(
        tmp_path, monkeypatch):
    recipe = load_recipe(TINY)
    run_dir = RunFolder(recipe, tmp_path / "run").prepare()
    log = MetricsLog(run_dir / "metrics.jsonl")
    calls = []

    def simulate(jobs, *_):
        calls.append([job.method.name for job in jobs])
        if len(calls) == 1:  # the first method finishes, the second starts, then Ray dies
            log.write({"method": jobs[0].method.name, "kind": "done", "rounds": 0})
            log.write({"method": jobs[1].method.name, "round": 1, "kind": "comm", "bytes_up": 0})
            raise RuntimeError("the Ray cluster went away")
        for job in jobs:
            log.write({"method": job.method.name, "kind": "done", "rounds": 2})

    monkeypatch.setattr(runner, "check_inputs", lambda _: None)
    monkeypatch.setattr(runner, "_simulate", simulate)
    monkeypatch.setattr(RunFolder, "report", lambda folder: RunResult(folder.path, {}, folder.path))
    with pytest.raises(UserError, match="method 'fedavg' did not finish: RuntimeError: the Ray cluster went away"):
        runner.run_recipe(recipe, run_dir)
    assert calls == [["pretrained", "fedavg", "comigs-1G1S"], ["comigs-1G1S"]]
    assert log.finished() == {"pretrained", "comigs-1G1S"}


def test_a_simulation_that_cannot_start_fails_every_method_once(tmp_path, monkeypatch):
    recipe = load_recipe(TINY)
    run_dir = RunFolder(recipe, tmp_path / "run").prepare()
    calls = []

    def no_ray(jobs, *_):
        calls.append(len(jobs))
        raise RuntimeError("Ray could not start")

    monkeypatch.setattr(runner, "check_inputs", lambda _: None)
    monkeypatch.setattr(runner, "_simulate", no_ray)
    with pytest.raises(UserError, match="Ray could not start"):
        runner.run_recipe(recipe, run_dir)
    assert calls == [3], "no second try when not even the first method started"
    errors = [r["method"] for r in MetricsLog(run_dir / "metrics.jsonl").read() if r["kind"] == "error"]
    assert errors == ["pretrained", "fedavg", "comigs-1G1S"]
