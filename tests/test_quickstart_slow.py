"""The README's quickstart, as written, on the real SmolLM2-135M (about two minutes on 2 cores):
its ``finetune`` command trains both methods, and its follow-up commands run on that run."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _quickstart_blocks() -> list[list[str]]:
    """The ``bash`` blocks of the README's Quickstart section: their commands, comments dropped."""
    section = README.read_text(encoding="utf-8").split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```bash\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    return [[line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]
            for block in blocks]


def _run(command: str, cwd: Path) -> str:
    words = shlex.split(command)
    assert words[0] == "ondevice-moe", command
    done = subprocess.run([sys.executable, "-m", "ondevice_moe", *words[1:]], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_the_readme_quickstart_runs_as_written(tmp_path, own_ray):
    start, follow_up = _quickstart_blocks()
    assert start == ["export HF_HUB_OFFLINE=1", "ondevice-moe finetune quickstart"]
    _run(start[1], tmp_path)
    summary = json.loads((tmp_path / "runs" / "quickstart" / "summary.json").read_text())
    for method in ("fedavg", "comigs-1G1S"):
        assert summary["methods"][method]["mean_in"] < 60, "real pretrained weights, a few steps of training"

    outputs = {command.split()[1]: _run(command, tmp_path) for command in follow_up}
    assert set(outputs) == {"generate", "export"}
    assert "def read_lines(path):" in outputs["generate"]
    config = json.loads((tmp_path / "out" / "news" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # As the README says: nothing but transformers and peft, offline, finds the base by its repository id.
    plain = ("import sys; from peft import AutoPeftModelForCausalLM; "
             "model = AutoPeftModelForCausalLM.from_pretrained('out/news'); "
             "assert 'ondevice_moe' not in sys.modules; print(type(model.base_model.model).__name__)")
    loaded = subprocess.run([sys.executable, "-c", plain], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert loaded.returncode == 0 and "LlamaForCausalLM" in loaded.stdout, loaded.stderr[-2000:]
