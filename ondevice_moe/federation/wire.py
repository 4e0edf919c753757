"""A message's tensors travel packed: one byte array and its index, whatever their number.

Flower makes every array of a message's ``ArrayRecord`` its own objects (the array and its
chunks of up to 5 MB), and on real devices moves each object with an HTTP request of its own,
through the SuperLink's object store; a reply whose objects are not all uploaded yet is retried
object by object after 1, 2, 4, 8 and 10 s (sooner since :mod:`~ondevice_moe.federation.prompt_pulls`).
The shared experts of a SmolLM2 FedAvg device are 600 tensors: 1,204 objects per message, and
pulling one reply took the ServerApp 3.7–6 s with every object in place (27.8 s when 7 were not
yet there), a SuperNode 19–21 s for an evaluation message (docs/deployment.md, "Measured").
Packed, a message is the index (names, dtypes and shapes, as JSON) and one buffer of every
tensor's bytes back to back: a handful of objects. The tensors lie in the buffer by element size,
largest first, so each starts at a multiple of its own element size and unpacks as a view of the
buffer, without a copy (a whole model's upload is hundreds of MB).

:func:`unpack` takes what a peer sent, so it trusts nothing in it: an index that is not a list of
``[name, dtype, shape]`` with known dtypes, whole non-negative sizes and distinct names, laid out
by element size, whose sizes do not add up to the buffer's, or a bool tensor of other bytes than 0
and 1, is a :class:`ValueError` saying which. A record that is not
packed (Flower's SecAgg+ workflow hands the handler its own) unpacks to its arrays as they are.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord

BUFFER_KEY = "packed/buffer"
INDEX_KEY = "packed/index"
DTYPES: dict[str, torch.dtype] = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def pack(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """``tensors`` as one index and one byte buffer (an empty record for no tensors)."""
    if not tensors:
        return ArrayRecord()
    index, parts = [], []
    for name, tensor in sorted(tensors.items(), key=lambda item: -item[1].element_size()):
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"{name} is a {dtype} tensor, which does not travel; use one of {sorted(DTYPES)}")
        index.append([name, dtype, list(tensor.shape)])
        parts.append(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
    text = json.dumps(index, separators=(",", ":")).encode()
    return ArrayRecord({INDEX_KEY: torch.frombuffer(bytearray(text), dtype=torch.uint8), BUFFER_KEY: torch.cat(parts)})


def unpack(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """The tensors ``record`` carries (views of one buffer of their own); see the module docstring."""
    if set(record) != {INDEX_KEY, BUFFER_KEY}:
        return dict(record.to_torch_state_dict())
    arrays = record.to_torch_state_dict()
    buffer = arrays[BUFFER_KEY]
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"the packed buffer is a {buffer.dtype} array of {buffer.dim()} dimensions, not bytes")
    entries = _index(arrays[INDEX_KEY])
    sizes = [math.prod(shape) * DTYPES[dtype].itemsize for _, dtype, shape in entries]
    if sum(sizes) != buffer.numel():
        raise ValueError(f"the packed index describes {sum(sizes)} bytes, the buffer holds {buffer.numel()}")
    tensors, offset = {}, 0
    for (name, dtype, shape), size in zip(entries, sizes, strict=True):
        piece = buffer[offset:offset + size]
        if DTYPES[dtype] == torch.bool and bool((piece > 1).any()):
            raise ValueError(f"{name} is a bool tensor holding bytes other than 0 and 1")
        tensors[name] = piece.view(DTYPES[dtype]).reshape(shape)
        offset += size
    return tensors


def record_bytes(record: ArrayRecord) -> int:
    """The bytes of the tensors ``record`` carries (``bytes_up`` / ``bytes_down`` in ``metrics.jsonl``),
    from the arrays' dtypes and shapes: nothing is deserialised, the index is not counted."""
    if set(record) == {INDEX_KEY, BUFFER_KEY}:
        return math.prod(record[BUFFER_KEY].shape)
    return sum(np.dtype(array.dtype).itemsize * math.prod(array.shape) for array in record.values())


def _index(array: torch.Tensor) -> list[tuple[str, str, list[int]]]:
    """The index's entries, each checked (see the module docstring)."""
    try:
        entries = json.loads(array.numpy().tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"the packed index is not JSON text ({error})") from None
    if not isinstance(entries, list):
        raise ValueError("the packed index is not a list of [name, dtype, shape]")
    names: set[str] = set()
    for position, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[2], list)):
            raise ValueError(f"the packed index entry {str(entry)[:80]} is not [name, dtype, shape]")
        name, dtype, shape = entry
        if dtype not in DTYPES:
            raise ValueError(f"{name} travelled as {str(dtype)[:20]!r}, not one of {sorted(DTYPES)}")
        if not all(isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape):
            raise ValueError(f"{name} has the shape {str(shape)[:80]}, not whole non-negative sizes")
        if name in names:
            raise ValueError(f"{name} travelled twice")
        if position and DTYPES[dtype].itemsize > DTYPES[entries[position - 1][1]].itemsize:
            raise ValueError(f"{name} ({dtype}) lies after a narrower dtype: the buffer is not laid out by "
                             "element size")
        names.add(name)
    return entries
