"""The peak bytes of live tensors during a step: on the CPU, what ``torch.cuda.max_memory_allocated`` is on CUDA.

A process's resident set also holds the allocator's free lists, pages of a memory-mapped
checkpoint not yet touched, and libraries; live tensors are what a model and its training
step need. :class:`LiveTensorPeak` counts them between operations: it starts from every
tensor Python holds (parameters, buffers, optimiser state, quantization constants), then
follows every operator's outputs through a ``TorchDispatchMode``, dropping a storage once
nothing holds it (``StorageWeakRef``). Views share their storage and count once.
Temporaries inside one operator (e.g. a bitsandbytes kernel's dequantized weight) are not
seen; CUDA's allocator would count them.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorPeak(TorchDispatchMode):
    """While active, tracks the peak total bytes of live tensor storages (``peak_bytes``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        gc.collect()  # tensors in unreachable cycles are not held: collected mid-step, they would lower the total
        with warnings.catch_warnings():  # isinstance on some modules' deprecated attributes warns
            warnings.simplefilter("ignore")
            # type(), not isinstance: a weakref.proxy (torch.compile keeps some) whose object is gone
            # raises on isinstance; a proxy is never a tensor here.
            held = [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor) and not t.is_meta]
        for tensor in held:
            self._add(tensor)
        self.peak_bytes = self._total()

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        size = storage.nbytes()
        # A fake tensor that torch.compile left behind has a symbolic size and no memory.
        if isinstance(size, int) and storage._cdata not in self.live:
            self.live[storage._cdata] = (StorageWeakRef(storage), size)

    def _total(self) -> int:
        return sum(size for _, size in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        made = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and not t.is_meta]
        if made:
            # Freed storages leave first: a new one may reuse a freed one's address.
            self.live = {key: entry for key, entry in self.live.items() if not entry[0].expired()}
            for tensor in made:
                self._add(tensor)
            self.peak_bytes = max(self.peak_bytes, self._total())
        return output


def peak_tensor_mib(step: Callable[[], None]) -> float:
    """The peak of live tensor storages while ``step`` runs, in MiB."""
    with LiveTensorPeak() as meter:
        step()
    return meter.peak_bytes / 2**20
