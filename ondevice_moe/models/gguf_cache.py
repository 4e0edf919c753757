"""Turn the SmolLM2 GGUF shipped on PyPI into a cached safetensors folder.

Loading the GGUF dequantises it (≈15 s, ≈1.2 GB); a cached folder then loads in
a fraction of a second. The cache is keyed by the GGUF file's SHA-256, so a new
package version never reuses a stale conversion.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from ondevice_moe.assets import cache_root


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cached_gguf_folder(gguf_path: Path) -> Path:
    """Return a ``from_pretrained``-ready folder for ``gguf_path``, converting once."""
    target = cache_root() / "models" / f"{gguf_path.stem}-{file_sha256(gguf_path)[:16]}"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # transformers marks GGUF models as quantized and refuses to save them;
    # the weights are already dequantised, so the marks can go.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").exists():  # not a lost race with another process
            raise
    return target
