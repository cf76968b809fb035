"""Count the bytes of live tensor storages on the CPU (or any device) without a CUDA allocator.

`LiveMemory` is a TorchDispatchMode: every storage an op creates is counted
until it is freed (a finalizer on the storage); tensors that exist already
(parameters, inputs) are added with `track`. `peak` is the most bytes live at
once. On CUDA, `torch.cuda.max_memory_allocated` is the measure instead.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveMemory", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind t (unique while it lives; works for fake tensors)."""
    return t.untyped_storage()._cdata


class LiveMemory(TorchDispatchMode):
    """Live and peak bytes of tensor storages created while active, plus those tracked."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def track(self, *tensors: Any) -> None:
        for t in pytree.tree_leaves(tensors):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
                self._add(t.untyped_storage())

    def _add(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        if key in self.live:
            return
        nbytes = st.nbytes()
        self.live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        nbytes = self.live.pop(key, 0)
        self.current -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self._add(t.untyped_storage())
        return out
