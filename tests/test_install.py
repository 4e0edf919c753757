"""The README's install, as written, into a fresh virtual environment (issue 65): its two core lines
build and install the package from a copy of the source (a wheel, not an editable install), ``pip check``
finds nothing broken, and the installed ``ondevice-moe`` plans the quickstart offline. About 100 s on
2 cores with pip's cache warm; the offline assets are the ones ``make setup`` unpacked."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _core_install_lines() -> list[str]:
    """The README Install block's ``pip install`` lines that make the core install (not the extras)."""
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("## Install", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```bash\n(.*?)^```", section, re.DOTALL | re.MULTILINE).group(1)
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [command for command in commands if command.startswith("pip install") and "[" not in command]


def _run(words: list[str], cwd: Path, env: dict[str, str], timeout: int = 900) -> str:
    done = subprocess.run(words, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{shlex.join(words)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_the_readme_install_makes_a_working_non_editable_install_with_nothing_broken(tmp_path):
    lines = _core_install_lines()
    assert lines == ["pip install torch==2.13.0", "pip install -c constraints.txt ."]
    source = tmp_path / "source"  # a copy, so that building leaves the checkout as it was
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env |= {"PATH": f"{venv / 'bin'}{os.pathsep}{env['PATH']}", "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    for line in lines:
        words = shlex.split(line)
        _run([str(venv / "bin" / "python"), "-m", *words], source, env)

    assert "No broken requirements" in _run([str(venv / "bin" / "python"), "-m", "pip", "check"], source, env)
    where = _run([str(venv / "bin" / "python"), "-c", "import ondevice_moe; print(ondevice_moe.__file__)"],
                 tmp_path, env)
    assert Path(where.strip()).is_relative_to(venv), "the package came from the venv's site-packages, not the source"
    planned = _run([str(venv / "bin" / "ondevice-moe"), "finetune", "quickstart", "--dry-run",
                    "--output", str(tmp_path / "run")], tmp_path, env)
    assert "dry run: nothing was trained" in planned and "news" in planned
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
