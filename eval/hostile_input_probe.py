"""Probe the CLI with crafted and careless input, as an attacker or a hurried user would.

Each case sets up files in a fresh folder, runs one ``ondevice-moe`` command there (offline, 120 s
at most) and is classed by what the user sees:

* **clear**: exit code 2, an ``error:`` line and a ``fix:`` line, no traceback;
* **poor**: refused without a traceback, but without both lines;
* **traceback**: a Python traceback reached the user;
* **hang**: still running after the time limit;
* **silent**: exit code 0 where the input should have been refused;
* **touched**: a file outside the case's folder was written or deleted (a sentinel folder is watched);
* **executed**: a crafted file made code run (the case's marker file appeared);
* **forged**: an escape character reached the output (a name or path could drive the terminal).

Usage: ``python eval/hostile_input_probe.py [--only NAME ...]``; prints a table and the counts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "recipes" / "tiny.yaml"
TINY_CLASSIFICATION = ROOT / "tests" / "recipes" / "tiny-classification.yaml"
CLI = str(Path(sys.executable).with_name("ondevice-moe"))
TIMEOUT_S = 120
NULL_TEXT = '{"text": null}\n'
SMALL_CSV = "text,label\na,pos\n"
BIG_CSV = "text,label\n" + "x" * 200_000 + ",pos\n"


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    arguments: Callable[[Path, Path], list[str]]  # (case folder, sentinel folder) -> CLI arguments
    refuse: bool = True  # whether the input must be refused


def tiny_with(folder: Path, text: str, base: Path = TINY) -> str:
    path = folder / "recipe.yaml"
    path.write_text(base.read_text() + "\n" + text)
    return str(path)


def written(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def fifo(folder: Path, name: str) -> Path:
    path = folder / name
    os.mkfifo(path)
    return path


def quick(*sets: str) -> list[str]:
    """A dry run (validation only) with ``--set`` overrides."""
    return [*(item for value in sets for item in ("--set", value)), "--dry-run"]


def run_folder(folder: Path, recipe_text: str, metrics: str = "") -> str:
    run = folder / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(recipe_text)
    (run / "metrics.jsonl").write_text(metrics)
    return str(run)


CASES = [
    # Paths: names and labels never become paths outside the run.
    Case("label an absolute path", "paths",
         lambda d, s: ["finetune", str(TINY), *quick(f"methods=[{{name: pretrained, label: {s}}}]")]),
    Case("label ..", "paths", lambda d, s: ["finetune", str(TINY), *quick("methods=[{name: fedavg, label: ..}]")]),
    Case("recipe name ../../x", "paths", lambda d, s: ["finetune", str(TINY), *quick("name=../../x")]),
    Case("recipe name absolute", "paths", lambda d, s: ["finetune", str(TINY), *quick(f"name={s}/x")]),
    Case("output folder is a file", "paths", lambda d, s: ["finetune", str(TINY), "--set", "methods=[pretrained]",
                                                           "--output", str(written(d, "file", "x"))]),
    Case("eval on a folder that is no run", "paths", lambda d, s: ["eval", str(d)]),
    # Crafted files: nothing runs, one message.
    Case("YAML alias bomb", "crafted files",
         lambda d, s: ["finetune", str(written(d, "bomb.yaml", "a: &a [x, x, x, x, x, x, x, x, x]\n"
                                                                "b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                                                                "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
                                                                "d: [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n")),
                       "--dry-run"]),
    Case("duplicate YAML key", "crafted files",
         lambda d, s: ["finetune", tiny_with(d, "seed: 3\nseed: 4"), "--dry-run"]),
    Case("python tag in a recipe", "crafted files",
         lambda d, s: ["finetune", tiny_with(d, f"data_seed: !!python/object/apply:os.system [touch {d}/EXECUTED]"),
                       "--dry-run"]),
    Case("recipe is a list", "crafted files", lambda d, s: ["finetune", str(written(d, "r.yaml", "- a\n- b\n")),
                                                           "--dry-run"]),
    Case("recipe is binary", "crafted files",
         lambda d, s: ["finetune", str(written(d, "r.yaml", "\x00\x01\x02\xff")), "--dry-run"]),
    Case("run folder with a crafted recipe", "crafted files",
         lambda d, s: ["eval", run_folder(d, "name: x\nname: y\n")]),
    Case("run folder with a garbage log", "crafted files",
         lambda d, s: ["eval", run_folder(d, TINY.read_text(), "not json at all\n{\"kind\": 1}\n")]),
    Case("run folder log records without a method", "crafted files",
         lambda d, s: ["eval", run_folder(d, TINY.read_text(), '{"kind": "done"}\n')]),
    Case("pickle weights as a model folder", "crafted files",
         lambda d, s: ["finetune", str(TINY), "--set", f"model.name={_pickle_model(d)}", "--set",
                       "methods=[pretrained]", "--output", str(d / "out")]),
    Case("garbage safetensors as a model folder", "crafted files",
         lambda d, s: ["finetune", str(TINY), "--set", f"model.name={_garbage_model(d)}", "--set",
                       "methods=[pretrained]", "--output", str(d / "out")]),
    # Numerics.
    Case("seed -1", "numerics", lambda d, s: ["finetune", str(TINY), "--seed", "-1", "--dry-run"]),
    Case("31-digit seed", "numerics", lambda d, s: ["finetune", str(TINY), *quick("seed=" + "9" * 31)]),
    Case("source weight .inf", "numerics",
         lambda d, s: ["finetune", str(TINY), *quick("data.users=[{name: a, source: python-code, weight: .inf}]")]),
    Case("cpus_per_client 1e-5", "numerics",
         lambda d, s: ["finetune", str(TINY), *quick("federation.cpus_per_client=1e-5")]),
    Case("fault of device 99", "numerics",
         lambda d, s: ["finetune", str(TINY), *quick("federation.faults=[{device: 99, kind: crash}]")]),
    Case("fault rounds 0, -3, 999", "numerics",
         lambda d, s: ["finetune", str(TINY),
                       *quick("federation.faults=[{device: 0, kind: crash, rounds: [0, -3, 999]}]")]),
    Case("SecAgg+ with one device a round", "numerics",
         lambda d, s: ["finetune", str(TINY), *quick("federation.secure_aggregation=secaggplus",
                                                     "federation.clients_per_round=1", "methods=[fedavg]")]),
    Case("min_clients above the devices", "numerics",
         lambda d, s: ["finetune", str(TINY), "--set", "federation.min_clients=9", "--set", "methods=[fedavg]",
                       "--output", str(d / "out")]),
    Case("lr 1e6 (divergence)", "numerics",
         lambda d, s: ["finetune", str(TINY), "--set", "training.lr=1e6", "--set", "methods=[fedavg]", "--set",
                       "federation.rounds=1", "--output", str(d / "out")]),
    # Data semantics: what would be silently wrong.
    Case("null text in a JSONL source", "data semantics",
         lambda d, s: ["finetune", str(TINY), "--set", "methods=[pretrained]", "--output", str(d / "out"), "--set",
                       f"data.users=[{{name: a, source: jsonl, path: {written(d, 't.jsonl', NULL_TEXT)}}}]"]),
    Case("FIFO as a JSONL source", "data semantics",
         lambda d, s: ["finetune", str(TINY), "--set", "methods=[pretrained]", "--output", str(d / "out"), "--set",
                       f"data.users=[{{name: a, source: jsonl, path: {fifo(d, 'f.jsonl')}}}]"]),
    Case("text column is the label", "data semantics",
         lambda d, s: ["finetune", str(TINY_CLASSIFICATION), "--dry-run", "--set",
                       f"task={{name: mine, path: {written(d, 'm.csv', SMALL_CSV)}, labels: [neg, pos], "
                       "text_columns: [label]}"]),
    Case("CSV field over 131,072 characters", "data semantics",
         lambda d, s: ["finetune", str(TINY_CLASSIFICATION), "--output", str(d / "out"), "--set",
                       "methods=[fed-lora]", "--set",
                       f"task={{name: big, path: {written(d, 'b.csv', BIG_CSV)}, "
                       "labels: [neg, pos]}"]),
    Case("source: device in the simulation", "data semantics",
         lambda d, s: ["finetune", str(TINY), "--set", "methods=[pretrained]", "--output", str(d / "out"), "--set",
                       "data.users=[{name: a, source: device}]"]),
    Case("a text folder with no text files", "data semantics",
         lambda d, s: ["finetune", str(TINY), "--set", "methods=[pretrained]", "--output", str(d / "out"), "--set",
                       f"data.users=[{{name: a, source: text-folder, path: {d}}}]"]),
    # Sizes no machine could hold: refused before anything is allocated.
    Case("10^7 clients", "bounds",
         lambda d, s: ["finetune", str(TINY_CLASSIFICATION), *quick("task.clients=10000000")]),
    Case("batch_size 10^7", "bounds", lambda d, s: ["finetune", str(TINY), *quick("data.batch_size=10000000")]),
    Case("train_tokens 10^15", "bounds",
         lambda d, s: ["finetune", str(TINY), *quick("data.train_tokens=1000000000000000")]),
    Case("local_iterations 10^12", "bounds",
         lambda d, s: ["finetune", str(TINY), *quick("federation.local_iterations=1000000000000")]),
    Case("LoRA rank 10^6", "bounds", lambda d, s: ["finetune", str(TINY), *quick("experts.lora_rank=1000000")]),
    Case("top_k above the experts", "bounds", lambda d, s: ["finetune", str(TINY), *quick("experts.top_k=5")]),
    Case("5000 clients over 1797 digits", "bounds",
         lambda d, s: ["finetune", str(ROOT / "ondevice_moe" / "recipes" / "floral-digits.yaml"),
                       *quick("task.clients=5000")]),
    Case("20 MB recipe", "bounds",
         lambda d, s: ["finetune", str(written(d, "big.yaml", "name: x\n#" + "a" * 20_000_000 + "\n")), "--dry-run"]),
    Case("recipe nested 5000 deep", "bounds",
         lambda d, s: ["finetune", str(written(d, "deep.yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n")), "--dry-run"]),
    Case("--set nested 3000 deep", "bounds",
         lambda d, s: ["finetune", str(TINY), *quick("data.batch_size=" + "[" * 3000)]),
    Case("inspect --file of 2 GiB", "bounds",
         lambda d, s: ["inspect", str(d), "--method", "fedavg", "--user", "a", "--to", str(d / "p.html"), "--file",
                       str(_sparse(d, "huge.txt", 2 * 2**30))]),
    Case("krum assuming as many liars as devices", "bounds",
         lambda d, s: ["finetune", str(TINY), *quick("federation.aggregation=krum", "federation.byzantine=3")]),
    Case("trimmed-mean that trims nothing", "bounds",
         lambda d, s: ["finetune", str(TINY), *quick("federation.aggregation=trimmed-mean")]),
    # Hangs and full disks.
    Case("recipe is a FIFO", "hangs and disks", lambda d, s: ["finetune", str(fifo(d, "r.yaml")), "--dry-run"]),
    Case("run folder whose log is a FIFO", "hangs and disks", lambda d, s: ["eval", _fifo_log_run(d)]),
    Case("recipes copy onto a full disk", "hangs and disks",
         lambda d, s: ["recipes", "copy", "demo", "/dev/full", "--force"]),
    # Output that could forge, and models that ask to run their code.
    Case("escape sequences in a path", "output", lambda d, s: ["eval", str(_forged_folder(d))]),
    Case("model folder with auto_map", "crafted files",
         lambda d, s: ["finetune", str(TINY), "--set", f"model.name={_custom_code_model(d)}", "--set",
                       "methods=[pretrained]", "--output", str(d / "out")]),
]


def _sparse(folder: Path, name: str, size: int) -> Path:
    path = folder / name
    with path.open("wb") as file:
        file.truncate(size)
    return path


def _fifo_log_run(folder: Path) -> str:
    run = folder / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(TINY.read_text())
    os.mkfifo(run / "metrics.jsonl")
    return str(run)


def _forged_folder(folder: Path) -> Path:
    forged = folder / "run\x1b]0;owned\x07\x1b[2J"
    forged.mkdir()
    return forged


def _custom_code_model(folder: Path) -> Path:
    model = folder / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, '
                                       '"auto_map": {"AutoModelForCausalLM": "evil.Model"}}')
    (model / "evil.py").write_text(f"open({str(folder / 'EXECUTED')!r}, 'w').close()\n")
    return model


def _pickle_model(folder: Path) -> Path:
    model = folder / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}')
    import pickle

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {folder}/EXECUTED",))

    (model / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    return model


def _garbage_model(folder: Path) -> Path:
    model = folder / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}')
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}")
    return model


def snapshot(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in folder.rglob("*")}


def probe(case: Case) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(prefix="probe-") as work, tempfile.TemporaryDirectory(prefix="sentinel-") as s:
        folder, sentinel = Path(work), Path(s)
        (sentinel / "keep.txt").write_text("the user's file")
        before = snapshot(sentinel)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
        try:
            result = subprocess.run([CLI, *case.arguments(folder, sentinel)], cwd=folder, env=env,
                                    capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "hang", f"still running after {TIMEOUT_S}s"
        output = (result.stdout + result.stderr).strip()
        last = " ".join(output.split())[-160:]
        if (folder / "EXECUTED").exists():
            return "executed", last
        if snapshot(sentinel) != before:
            return "touched", last
        if "Traceback" in output:
            return "traceback", last
        if "\x1b" in output:  # not a terminal: rich adds no styles, so any escape came from the input
            return "forged", last
        if result.returncode == 0:
            return ("silent" if case.refuse else "clear"), last
        has_both = "error:" in output and "fix:" in output
        return ("clear" if result.returncode == 2 and has_both else "poor"), last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", help="names of cases to run (default: all)")
    args = parser.parse_args()
    cases = [case for case in CASES if not args.only or case.name in args.only]
    counts: Counter = Counter()
    print("| family | case | outcome | what the user saw (end) |\n|---|---|---|---|")
    for case in cases:
        outcome, seen = probe(case)
        counts[outcome] += 1
        print(f"| {case.family} | {case.name} | {outcome} | {seen.replace('|', '/')} |", flush=True)
    print("\n" + ", ".join(f"{outcome} {counts[outcome]}" for outcome in
                           ("clear", "poor", "traceback", "hang", "silent", "touched", "executed", "forged")))


if __name__ == "__main__":
    main()
