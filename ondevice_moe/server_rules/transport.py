"""Compressed transport of shared tensors (recipe ``federation.transport``).

What travels between the server and the devices, both ways, is the shared
tensors *encoded* for the wire; each side decodes what it receives before use:

* ``fp32``: as they are (the default: runs are bit-for-bit those without compression);
* ``bf16`` / ``fp16``: floating tensors cast to bfloat16 / float16 (bfloat16 travels as
  its bits viewed as int16: Flower's arrays are NumPy's, which has no bfloat16);
* ``int8``: symmetric per-tensor quantization, ``s = max|x| / 127``,
  ``q = round(x / s)`` clamped to [−127, 127]; ``q`` travels as int8 under the
  tensor's name and ``s`` as a float32 scalar under ``<name>::scale``
  (an all-zero tensor has ``s = 0`` and decodes to zeros).

Integer tensors (HetLoRA's kept ranks) travel as they are under every kind.
Byte counts (``bytes_up``/``bytes_down`` in ``metrics.jsonl``) are those of the
encoded arrays, scales included (:func:`~ondevice_moe.federation.wire.record_bytes`). The
server averages decoded values and encodes what it sends down the same way, so it never
learns more than was sent.
Encoding is deterministic (round half to even), so a resumed run repeats it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

Transport = Literal["fp32", "bf16", "fp16", "int8"]
SCALE_SUFFIX = "::scale"
INT8_LEVELS = 127
_CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16}
WIRE_DTYPES = {"bf16": torch.int16, "fp16": torch.float16, "int8": torch.int8}


def encode(tensors: Mapping[str, torch.Tensor], kind: Transport) -> dict[str, torch.Tensor]:
    """The arrays that travel for ``tensors`` under ``kind``. Meta tensors give meta arrays: the
    names, shapes and dtypes an upload must have on the wire (what the server checks it against)."""
    if kind == "fp32":
        return dict(tensors)
    wire: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            wire[name] = tensor
        elif kind == "int8":
            wire[name], wire[name + SCALE_SUFFIX] = quantize(tensor)
        else:
            wire[name] = tensor.detach().to(_CASTS[kind]).view(WIRE_DTYPES[kind])
    return wire


def quantize(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``: the int8 values and the float32 scale of one tensor (see the module docstring)."""
    values = tensor.detach().float()
    scale = values.abs().amax() / INT8_LEVELS if values.numel() else values.new_zeros(())
    # An all-zero tensor has s = 0 and q = 0 (divided by 1 instead: any divisor gives zeros).
    levels = torch.round(values / torch.where(scale > 0, scale, 1.0)).clamp(-INT8_LEVELS, INT8_LEVELS)
    return levels.to(torch.int8), scale.reshape(())


def decode(wire: Mapping[str, torch.Tensor], kind: Transport,
           like: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``wire`` carries: floating ones in the receiver's dtype (``like[name]``'s,
    float32 for a name ``like`` lacks). A tensor not sent as ``kind`` sends it is a
    :class:`ValueError` naming it."""
    if kind == "fp32":
        return dict(wire)
    like = like or {}
    tensors: dict[str, torch.Tensor] = {}
    for name, array in wire.items():
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in wire:
                raise ValueError(f"{name} travelled without its tensor")
            continue
        if not array.is_floating_point() and array.dtype != WIRE_DTYPES[kind]:
            tensors[name] = array  # integer state travels as it is
            continue
        dtype = like[name].dtype if name in like and like[name].is_floating_point() else torch.float32
        tensors[name] = _decode_one(name, array, wire, kind).to(dtype)
    return tensors


def _decode_one(name: str, array: torch.Tensor, wire: Mapping[str, torch.Tensor], kind: Transport) -> torch.Tensor:
    expected = WIRE_DTYPES[kind]
    if array.dtype != expected:
        raise ValueError(f"{name} travelled as {array.dtype}, expected {expected} (federation.transport {kind})")
    if kind != "int8":
        return array.view(_CASTS[kind])
    scale = wire.get(name + SCALE_SUFFIX)
    if scale is None or scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"{name} travelled without a float32 scalar {name}{SCALE_SUFFIX}")
    return array.float() * scale.reshape(())
