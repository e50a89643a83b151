"""The rows of a step's loaded chunk blocks, staged to be placed into the paged cache: every layer
at once, or (layer-wise loading) one layer group at a time as its reads come in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ucm.integration.vllm.connector.metadata import BlockLoad, RequestStep


@dataclass
class StagedChunks:
    staging: torch.Tensor  # [rows, layers, 2, H, D]: the view of layer-major storage the reads fill
    # (staging rows, the block's rows read into another buffer): copied as their layers come
    partial: list[tuple[torch.Tensor, torch.Tensor]]
    used: torch.Tensor | None  # staging rows of the blocks that loaded (None: every row)
    slots: torch.Tensor  # [n] cache slots of the used rows
    deltas: torch.Tensor  # [n] RoPE position shift of each

    def layers(self, start: int, end: int) -> torch.Tensor:
        """Layers [start, end) of the used rows, `[n, end - start, 2, H, D]`, in a buffer of ours."""
        for into, rows_read in self.partial:
            into[:, start:end] = rows_read[:, start:end]
        kv = self.staging[:, start:end]
        return kv if self.used is None else kv[self.used]


def stage_chunks(chunks: Sequence[tuple[RequestStep, BlockLoad]], destinations: Sequence[torch.Tensor],
                 ok: Sequence[bool], staging: torch.Tensor,
                 slots_of: Callable[[RequestStep, int, int], torch.Tensor], device) -> StagedChunks | None:
    """The loaded chunk blocks' rows (`ok`: which loaded; `slots_of(req, start, n)`: cache slots);
    None when none loaded. A block that did not load is left out: the forward computes its tokens."""
    rows, slots, deltas, partial, offset = [], [], [], [], 0
    for (req, ld), buf, good in zip(chunks, destinations, ok):
        n = ld.num_tokens - ld.skip
        if good:
            if not ld.whole:
                partial.append((staging[offset:offset + n], buf[ld.rows]))
            rows.append(torch.arange(offset, offset + n))
            slots.append(slots_of(req, ld.start + ld.skip, n))
            deltas.append(torch.full((n,), ld.rope_delta, dtype=torch.long))
        offset += n
    if not rows:
        return None
    used = None if offset == sum(len(r) for r in rows) else torch.cat(rows)
    return StagedChunks(staging, partial, used, torch.cat(slots).to(device), torch.cat(deltas))
