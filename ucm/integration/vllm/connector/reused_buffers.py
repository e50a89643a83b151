"""CPU buffers a worker reuses from step to step (load staging, the RoPE's rotation).

Fresh large allocations cost page faults on first touch: the store reads into fresh memory at a
fraction of its speed into memory touched before, and a fresh float32 copy for the RoPE costs
several times the copy itself (docs/research.md, "The probe's candidates").
"""

from __future__ import annotations

import torch


class ReusedBuffers:
    def __init__(self, min_rows: int):
        self.min_rows = min_rows
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, dim: int = 0) -> torch.Tensor:
        """The first ``shape[dim]`` rows along ``dim`` of the buffer kept under ``name``, grown to
        the largest size asked for."""
        buf = self._buffers.get(name)
        other = (*shape[:dim], *shape[dim + 1:])
        if (buf is None or buf.shape[dim] < shape[dim] or (*buf.shape[:dim], *buf.shape[dim + 1:]) != other
                or buf.dtype != dtype):
            grown = list(shape)
            grown[dim] = max(shape[dim], self.min_rows)
            buf = self._buffers[name] = torch.empty(grown, dtype=dtype)
        return buf.narrow(dim, 0, shape[dim])

    def drop(self, *names: str) -> None:
        """Never hands these out again: the store's IO threads may still be writing them."""
        for name in names:
            self._buffers.pop(name, None)
