"""Where a step's block reads land, so one store task reads every block of the step.

Chunk blocks read whole land back to back in a staging tensor, in the order of their rows in the
Blend forward; a chunk block partly covered by the exact prefix, or read through a reference to
exact blocks, is read whole into a second buffer and its wanted rows are copied into the staging
tensor afterwards; exact-prefix blocks are read into that second buffer too. Neighbouring chunk
blocks read through references often name the same stored block: it is read once per step
(`shared_reads`), into one place of the second buffer that both take their rows from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ucm.integration.vllm.connector.metadata import BlockLoad, UCMConnectorMetadata


def num_reads(meta: UCMConnectorMetadata) -> int:
    """Blocks the step reads inside the step (chunk and exact-prefix blocks)."""
    return sum(len(req.chunk_loads) + len(req.prefix_loads) for req in meta.requests)


def staged_rows(chunks: Sequence[BlockLoad]) -> int:
    """Rows of the staging tensor: every wanted row of every chunk block."""
    return sum(ld.num_tokens - ld.skip for ld in chunks)


def shared_reads(chunks: Sequence[BlockLoad]) -> dict[int, int]:
    """Chunk blocks not read straight into place whose stored block an earlier one of the step
    reads too: index -> that earlier index (read once, its outcome theirs)."""
    first: dict[tuple[bytes, int], int] = {}
    shared = {}
    for i, ld in enumerate(chunks):
        if not ld.whole:
            j = first.setdefault((ld.key, ld.stored_rows), i)
            if j != i:
                shared[i] = j
    return shared


def whole_rows(chunks: Sequence[BlockLoad], prefix: Sequence[BlockLoad], shared: dict[int, int]) -> int:
    """Rows of the second buffer: chunk blocks not read straight into place (each stored block
    once), and prefix blocks."""
    return (sum(ld.stored_rows for i, ld in enumerate(chunks) if not ld.whole and i not in shared)
            + sum(ld.num_tokens for ld in prefix))


def read_destinations(chunks: Sequence[BlockLoad], prefix: Sequence[BlockLoad], staging: torch.Tensor,
                      whole_buffer: Callable[[int], torch.Tensor]) -> tuple[list[torch.Tensor], dict[int, int]]:
    """Each block's destination, chunk blocks first then prefix blocks (views of the staging tensor
    and of `whole_buffer(rows)`, the second buffer), and the `shared_reads`, whose blocks get the
    same view."""
    shared = shared_reads(chunks)
    whole = whole_buffer(whole_rows(chunks, prefix, shared))
    destinations, offset, at = [], 0, 0
    for i, ld in enumerate(chunks):
        n = ld.num_tokens - ld.skip
        if ld.whole:
            destinations.append(staging[offset:offset + n])
        elif i in shared:
            destinations.append(destinations[shared[i]])
        else:
            destinations.append(whole[at:at + ld.stored_rows])
            at += ld.stored_rows
        offset += n
    for ld in prefix:
        destinations.append(whole[at:at + ld.num_tokens])
        at += ld.num_tokens
    return destinations, shared
