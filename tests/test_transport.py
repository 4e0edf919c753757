"""Compressed transport of shared tensors (``federation.transport``)."""

import json
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord

from ondevice_moe import runner
from ondevice_moe.errors import UserError
from ondevice_moe.federation.faults import poison
from ondevice_moe.federation.strategy import decode_update
from ondevice_moe.federation.wire import pack, record_bytes, unpack
from ondevice_moe.recipe import load_recipe
from ondevice_moe.server_rules.aggregation import Update
from ondevice_moe.server_rules.transport import SCALE_SUFFIX, decode, encode

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"a.lora_A": torch.randn(8, 64, generator=generator) * 0.02,
            "a.lora_B": torch.randn(64, 8, generator=generator) * 3.0}


def _round_trip(tensors: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """Encode, travel packed in a Flower ArrayRecord, decode."""
    return decode(unpack(pack(encode(tensors, kind))), kind)


def test_fp32_is_the_identity():
    tensors = _tensors()
    decoded = _round_trip(tensors, "fp32")
    assert all(torch.equal(decoded[name], tensors[name]) for name in tensors)


def test_int8_error_is_at_most_half_a_step():
    tensors = _tensors()
    wire = encode(tensors, "int8")
    decoded = _round_trip(tensors, "int8")
    for name, tensor in tensors.items():
        scale = wire[name + SCALE_SUFFIX]
        assert wire[name].dtype == torch.int8 and int(wire[name].abs().max()) == 127
        assert torch.isclose(scale, tensor.abs().max() / 127)
        assert decoded[name].dtype == torch.float32
        assert (decoded[name] - tensor).abs().max() <= scale / 2 * (1 + 1e-5)


# Unit roundoff; and half the spacing of float16's subnormals, below 2^-14.
@pytest.mark.parametrize(("kind", "precision", "floor"), [("bf16", 2.0**-8, 0.0), ("fp16", 2.0**-11, 2.0**-25)])
def test_half_precision_relative_error(kind, precision, floor):
    tensors = _tensors()
    decoded = _round_trip(tensors, kind)
    for name, tensor in tensors.items():
        assert decoded[name].dtype == torch.float32
        assert ((decoded[name] - tensor).abs() <= precision * tensor.abs() + floor).all()
        assert not torch.equal(decoded[name], tensor)  # it really was rounded


def test_decoding_gives_the_receivers_dtype():
    tensors = _tensors()
    like = {"a.lora_A": torch.empty(0, dtype=torch.bfloat16, device="meta")}
    decoded = decode(encode(tensors, "int8"), "int8", like)
    assert decoded["a.lora_A"].dtype == torch.bfloat16 and decoded["a.lora_B"].dtype == torch.float32


@pytest.mark.parametrize("kind", ["int8", "bf16", "fp16"])
def test_all_zero_and_integer_tensors_travel_exactly(kind):
    tensors = {"zeros": torch.zeros(3, 4), "ranks": torch.tensor([4, 8], dtype=torch.int64)}
    decoded = _round_trip(tensors, kind)
    assert torch.equal(decoded["zeros"], tensors["zeros"])
    assert torch.equal(decoded["ranks"], tensors["ranks"]) and decoded["ranks"].dtype == torch.int64


def test_int8_upload_takes_a_quarter_of_the_bytes_plus_scales():
    tensors = _tensors()
    fp32 = record_bytes(pack(encode(tensors, "fp32")))
    assert fp32 == 4 * sum(t.numel() for t in tensors.values()) == record_bytes(ArrayRecord(encode(tensors, "fp32")))
    assert record_bytes(pack(encode(tensors, "int8"))) == fp32 // 4 + 4 * len(tensors)
    assert record_bytes(pack(encode(tensors, "bf16"))) == fp32 // 2


def test_wrong_or_incomplete_uploads_are_rejected():
    reference = {name: torch.empty(t.shape, device="meta") for name, t in _tensors().items()}
    wire = encode(_tensors(), "int8")
    update, problem = decode_update(Update(0, wire, 10), reference, "int8", partial=False)
    assert problem is None and update.tensors.keys() == reference.keys()
    as_fp32 = {**wire, "a.lora_A": _tensors()["a.lora_A"]}
    _, problem = decode_update(Update(1, as_fp32, 10), reference, "int8", partial=False)
    assert "oversized a.lora_A" in problem
    no_scale = {name: t for name, t in wire.items() if name != "a.lora_A" + SCALE_SUFFIX}
    _, problem = decode_update(Update(2, no_scale, 10), reference, "int8", partial=False)
    assert "missing ['a.lora_A::scale']" in problem
    _, problem = decode_update(Update(3, no_scale, 10), reference, "int8", partial=True)  # Hermes: subsets pass
    assert "without a float32 scalar a.lora_A::scale" in problem
    _, problem = decode_update(Update(4, poison(wire), 10), reference, "int8", partial=False)
    assert "non-finite values in a.lora_A::scale" in problem
    fp16 = encode(_tensors(), "fp16")
    _, problem = decode_update(Update(5, fp16, 10), reference, "bf16", partial=False)
    assert "travelled as torch.float16, expected torch.int16" in problem


def test_unknown_transport_names_the_key():
    with pytest.raises(UserError, match=r"federation\.transport"):
        load_recipe(TINY, ["federation.transport=int4"])


def _run(tmp_path: Path, kind: str) -> tuple[dict, list[dict]]:
    recipe = load_recipe(TINY, ["methods=[{name: comigs, variant: 1G1S}]", "federation.rounds=2",
                                "federation.local_iterations=1", f"federation.transport={kind}"])
    result = runner.run_recipe(recipe, tmp_path / kind)
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return result.summary["methods"]["comigs-1G1S"], [r for r in records if r["kind"] == "comm"]


def test_int8_federation_sends_a_quarter_and_scores_alike(tmp_path):
    fp32, fp32_comm = _run(tmp_path, "fp32")
    int8, int8_comm = _run(tmp_path, "int8")
    for key in ("bytes_up", "bytes_down"):
        ratio = int8_comm[-1][key] / fp32_comm[-1][key]
        assert 0.25 < ratio < 0.26, (key, ratio)
    for user, values in fp32["per_user"].items():
        assert int8["per_user"][user]["in"] == pytest.approx(values["in"], rel=0.01)
