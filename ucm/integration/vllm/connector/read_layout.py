"""Where a step's block reads land, so one store task reads every block of the step.

Chunk blocks read whole land back to back in a staging tensor, in the order of their rows in the
Blend forward; a chunk block partly covered by the exact prefix, or read through a reference to
exact blocks, is read whole into a second buffer and its wanted rows are copied into the staging
tensor afterwards; exact-prefix blocks are read into that second buffer too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ucm.integration.vllm.connector.metadata import BlockLoad, UCMConnectorMetadata


def num_reads(meta: UCMConnectorMetadata) -> int:
    """Blocks the step reads inside the step (chunk and exact-prefix blocks)."""
    return sum(len(req.chunk_loads) + len(req.prefix_loads) for req in meta.requests)


def staged_rows(chunks: Sequence[BlockLoad]) -> int:
    """Rows of the staging tensor: every wanted row of every chunk block."""
    return sum(ld.num_tokens - ld.skip for ld in chunks)


def whole_rows(chunks: Sequence[BlockLoad], prefix: Sequence[BlockLoad]) -> int:
    """Rows of the second buffer: chunk blocks not read straight into place, and prefix blocks."""
    return sum(ld.stored_rows for ld in chunks if not ld.whole) + sum(ld.num_tokens for ld in prefix)


def read_destinations(chunks: Sequence[BlockLoad], prefix: Sequence[BlockLoad], staging: torch.Tensor,
                      whole: torch.Tensor) -> list[torch.Tensor]:
    """Each block's destination, chunk blocks first then prefix blocks (views of the two buffers)."""
    destinations, offset, at = [], 0, 0
    for ld in chunks:
        n = ld.num_tokens - ld.skip
        if ld.whole:
            destinations.append(staging[offset:offset + n])
        else:
            destinations.append(whole[at:at + ld.stored_rows])
            at += ld.stored_rows
        offset += n
    for ld in prefix:
        destinations.append(whole[at:at + ld.num_tokens])
        at += ld.num_tokens
    return destinations
