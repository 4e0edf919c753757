"""A message's tensors travel packed (ondevice_moe/federation/wire.py): exactly, in a handful of
Flower objects whatever their number, and a crafted index is one clear error, never a crash."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import ArrayRecord
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from ondevice_moe.federation.wire import BUFFER_KEY, INDEX_KEY, pack, record_bytes, unpack


def _mixed() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"lora_A": torch.randn(8, 64, generator=generator),
            "lora_B.bf16": torch.randn(64, 8, generator=generator).to(torch.bfloat16),
            "codes": torch.randint(-127, 127, (5, 3), generator=generator, dtype=torch.int8),
            "ranks": torch.tensor([4, 8], dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "scale": torch.tensor(0.25),  # 0-dimensional
            "empty": torch.zeros(0, 4)}


def test_every_dtype_and_shape_travels_exactly_in_one_buffer():
    tensors = _mixed()
    record = pack(tensors)
    assert set(record) == {INDEX_KEY, BUFFER_KEY}
    back = unpack(record)
    assert set(back) == set(tensors)
    sizes = [back[name].element_size() for name in back]
    assert sizes == sorted(sizes, reverse=True)  # laid out by element size: every tensor a view, no copy
    assert len({t.untyped_storage().data_ptr() for t in back.values()}) == 1
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name], tensor), name
    assert record_bytes(record) == sum(t.numel() * t.element_size() for t in tensors.values())
    back["lora_A"] += 1  # the views share one buffer of this unpacking, not the record's bytes
    assert torch.equal(unpack(record)["lora_A"], tensors["lora_A"])
    assert torch.equal(back["lora_B.bf16"], tensors["lora_B.bf16"])


def _flower_objects(record: ArrayRecord) -> int:
    """The objects Flower stores and moves one by one for ``record`` (the message adds one)."""
    return len(get_all_nested_objects(record))


def test_a_message_of_600_tensors_is_a_handful_of_flower_objects_not_1200():
    generator = torch.Generator().manual_seed(0)  # distinct tensors: Flower stores equal objects once
    tensors = {f"layers.{i}.lora_{side}": torch.randn(576, 8, generator=generator)
               for i in range(300) for side in "AB"}  # 11 MB
    plain, packed = _flower_objects(ArrayRecord(tensors)), _flower_objects(pack(tensors))
    assert plain > 1200  # an array and its chunk per tensor, then the record
    assert packed <= 7  # the index and its chunk, the buffer and its 5 MB chunks, the record


def test_a_plain_record_unpacks_to_its_arrays():  # what Flower's SecAgg+ workflow hands the handler
    tensors = {"a": torch.ones(2, 3), "b": torch.arange(4)}
    back = unpack(ArrayRecord(tensors))
    assert set(back) == {"a", "b"} and torch.equal(back["b"], tensors["b"])
    assert unpack(pack({})) == {} and len(pack({})) == 0


def _forged(entries: object, buffer: torch.Tensor | None = None, raw: bytes | None = None) -> ArrayRecord:
    text = raw if raw is not None else json.dumps(entries).encode()
    return ArrayRecord({INDEX_KEY: torch.frombuffer(bytearray(text), dtype=torch.uint8),
                        BUFFER_KEY: torch.zeros(16, dtype=torch.uint8) if buffer is None else buffer})


@pytest.mark.parametrize(("record", "message"), [
    (_forged(None, raw=b"\xff\xfe not json"), "not JSON text"),
    (_forged({"a": 1}), "not a list"),
    (_forged([["a", "float32"]]), "is not [name, dtype, shape]"),
    (_forged([["a", "object", [4]]]), "travelled as 'object'"),
    (_forged([["a", "float32", [-4, -1]]]), "not whole non-negative sizes"),
    (_forged([["a", "float32", [2.5]]]), "not whole non-negative sizes"),
    (_forged([["a", "float32", [2]], ["a", "float32", [2]]]), "travelled twice"),
    (_forged([["a", "float32", [10**12]]]), "describes 4000000000000 bytes, the buffer holds 16"),
    (_forged([["a", "float32", [4]]], buffer=torch.zeros(4)), "not bytes"),
    (_forged([["a", "int8", [2]], ["b", "float32", [3]], ["c", "int16", [1]]]), "lies after a narrower dtype"),
    (_forged([["m", "bool", [16]]], buffer=torch.full((16,), 7, dtype=torch.uint8)), "bytes other than 0 and 1"),
], ids=["not-json", "not-a-list", "short-entry", "unknown-dtype", "negative-shape", "fractional-shape",
        "duplicate", "too-large", "float-buffer", "misaligned", "bool-bytes"])
def test_a_crafted_index_is_one_clear_error(record, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        unpack(record)


def test_a_tensor_of_an_unknown_dtype_is_refused_before_it_travels():
    with pytest.raises(ValueError, match="complex64 tensor, which does not travel"):
        pack({"z": torch.zeros(2, dtype=torch.complex64)})
