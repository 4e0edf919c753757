"""The offline bases land in the Hugging Face hub cache under their repositories, so plain ``transformers``
(and PEFT, for an export naming that id) load them offline with nothing of the toolkit's; a real download
already there is never replaced."""

import json
import os
import subprocess
import sys

import pytest

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
PLAIN_LOAD = f"""
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
ids = AutoTokenizer.from_pretrained("{SMOLLM2}")("def main():", return_tensors="pt")["input_ids"]
with torch.no_grad():
    logits = AutoModelForCausalLM.from_pretrained("{SMOLLM2}", dtype=torch.float32)(ids).logits
torch.save((ids, logits), "plain.pt")
AutoModel.from_pretrained("{MINILM}")
"""


def _python(code: str, cache, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


@pytest.mark.slow
def test_plain_transformers_loads_the_offline_bases_by_their_repository_ids(tmp_path):
    import torch

    from ondevice_moe.models.registry import load_base_model

    cache = tmp_path / "hub"
    assert "OSError" in _python(PLAIN_LOAD, cache, tmp_path).stderr  # not there before setup
    placed = _python("from ondevice_moe.models.registry import prepare_offline_models as p; print(p())", cache,
                     tmp_path)
    assert placed.returncode == 0 and "smollm2-135m" in placed.stdout and "minilm-l6" in placed.stdout, placed.stderr
    loaded = _python(PLAIN_LOAD, cache, tmp_path)
    assert loaded.returncode == 0, loaded.stderr
    ids, logits = torch.load(tmp_path / "plain.pt")
    with torch.no_grad():
        ours = load_base_model("smollm2-135m").model(ids).logits
    torch.testing.assert_close(logits, ours)  # the toolkit's weights, under the repository's name
    marker = next((cache / f"models--{SMOLLM2.replace('/', '--')}" / "snapshots").glob("*/ondevice_moe_*.json"))
    assert "GGUF" in json.loads(marker.read_text())["source"]


def test_a_real_download_in_the_cache_is_never_replaced(tmp_path, monkeypatch):
    from ondevice_moe.models import hub_cache

    monkeypatch.setattr(hub_cache, "hub_cache_root", lambda: tmp_path)
    real = hub_cache.repository_folder(SMOLLM2) / "refs" / "main"
    real.parent.mkdir(parents=True)
    real.write_text("a1b2c3")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert hub_cache.place_in_hub_cache(model, SMOLLM2, "f" * 64, "test") is None
    assert real.read_text() == "a1b2c3" and hub_cache.offline_copy_of(SMOLLM2) is None


def test_a_placed_copy_says_what_it_is(tmp_path, monkeypatch):
    from ondevice_moe.models import hub_cache

    monkeypatch.setattr(hub_cache, "hub_cache_root", lambda: tmp_path)
    model = tmp_path / "model"
    (model / "1_Pooling").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "1_Pooling" / "config.json").write_text("{}")
    snapshot = hub_cache.place_in_hub_cache(model, MINILM, "ab" * 32, "a wheel")
    assert snapshot is not None and (snapshot / "1_Pooling" / "config.json").is_file()
    assert hub_cache.offline_copy_of(MINILM) == {"repository": MINILM, "source": "a wheel", "sha256": "ab" * 32}
    assert (hub_cache.repository_folder(MINILM) / "refs" / "main").read_text() == snapshot.name
