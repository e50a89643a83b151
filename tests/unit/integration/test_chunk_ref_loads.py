"""A chunk block read through a reference places the same KV as its stored copy did.

The worker half on a real store directory and a real paged KV cache (vLLM's CPU layout), no
engine: a prompt's KV is dumped as exact blocks and, the old way, a chunk block's copy rotated
back to chunk-local positions. Another prompt then loads that chunk block at a new offset, once
from the copy and once from rows of the exact blocks (as the scheduler plans a reference); both
must put the same K (rotated to the new positions) and V in the cache.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ucm.integration.vllm.kv_layout import layout_for
from ucm.integration.vllm.connector.metadata import BlendRegion, BlockDump, BlockLoad, RequestStep, UCMConnectorMetadata
from ucm.integration.vllm.connector.worker_side import WorkerSide
from ucm.integration.vllm.connector.key_rotation import KeyRotation
from ucm.sparse.blend.chunk_refs import make_ref, ref_pieces
from ucm.sparse.blend.chunking import Span
from ucm.store.factory import create_store
from ucm.store.keys import KeyKind, store_key

BS, LAYERS, H, D = 16, 2, 2, 64
CHUNK = Span(21, 37)  # a chunk block of prompt A: rows 21..36, in A's exact blocks 1 and 2


def neox_cos_sin(max_pos: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def worker(tmp_path) -> WorkerSide:
    store = create_store("UcmNfsStore", {"storage_backends": str(tmp_path / "store")})
    w = WorkerSide(SimpleNamespace(cache_config=SimpleNamespace(block_size=BS)), store, check_layer=None)
    w.caches = [torch.zeros(16, H, BS, 2 * D) for _ in range(LAYERS)]
    w.layout = layout_for(w.caches[0], "CPU_ATTN", BS, H, D, isa="vec")
    w._token_shape, w._dtype, w._device = (LAYERS, 2, H, D), torch.float32, torch.device("cpu")
    w.token_bytes = LAYERS * 2 * H * D * 4
    w.check_layer, w.rotation = 1, KeyRotation(neox_cos_sin(512), True, D)
    return w


def kv_at(w: WorkerSide, block_ids: list[int], positions: range) -> torch.Tensor:
    slots = torch.tensor([block_ids[p // BS] * BS + p % BS for p in positions])
    return torch.stack([torch.stack(w.layout.gather(cache, slots), dim=1) for cache in w.caches], dim=1)


def load_step(block_ids: list[int], loads: list[BlockLoad], new_start: int) -> UCMConnectorMetadata:
    end = new_start + len(CHUNK) + 4
    step = RequestStep("b", block_ids, end, 1, chunk_loads=loads,
                       blend=BlendRegion(0, [5] * end, 0.15, question_end=end + 1, chunk_starts=[new_start]))
    return UCMConnectorMetadata([step])


@pytest.mark.parametrize("new_start,pieces", [(50, [(50, 11, 5), (61, 5, 0)]),  # moved later: K rotated forward
                                              (3, [(3, 11, 5), (14, 5, 0)])])  # moved earlier: back
def test_a_reference_places_what_the_chunk_copy_placed(tmp_path, new_start, pieces):
    """`new_start`: where prompt B has the same block (the chunk starts there in both prompts)."""
    w = worker(tmp_path)
    a_blocks, b_blocks = [1, 2, 3], [8, 9, 10, 11, 12]
    gen = torch.Generator().manual_seed(0)
    for cache in w.caches:
        cache[a_blocks] = torch.randn((len(a_blocks), H, BS, 2 * D), generator=gen)
    exact = [store_key(b"ns", KeyKind.EXACT, bytes([i]) * 32) for i in range(3)]
    copy = store_key(b"ns", KeyKind.CHUNK, b"\x07" * 32)
    dumps = [BlockDump(k, i * BS, BS) for i, k in enumerate(exact)]
    dumps.append(BlockDump(copy, CHUNK.start, len(CHUNK), rope_delta=CHUNK.start))  # chunk-local, the old way
    w.wait_for_save(UCMConnectorMetadata([RequestStep("a", a_blocks, 0, 3 * BS, dumps=dumps)]))
    w._reap_dumps(block=True)
    assert w.build_report().stored == {d.key: 1 for d in dumps}

    # The chunk block's chunk starts at its first token in both prompts: rotate by new_start.
    w.start_load_kv(load_step(b_blocks, [BlockLoad(copy, new_start, len(CHUNK), new_start)], new_start))
    from_copy = kv_at(w, b_blocks, range(new_start, new_start + len(CHUNK)))
    for cache in w.caches:
        cache[b_blocks] = 0

    ref = make_ref(CHUNK, [bytes([i]) * 32 for i in range(3)], BS)
    loads = [BlockLoad(exact[p.source[0]], p.start, len(p.rows), p.rope_delta, rows_from=p.rows.start,
                       stored_tokens=BS)
             for p in ref_pieces(ref, Span(new_start, new_start + len(CHUNK)), new_start)]
    assert [(ld.start, ld.num_tokens, ld.rows_from) for ld in loads] == pieces
    w.start_load_kv(load_step(b_blocks, loads, new_start))
    from_ref = kv_at(w, b_blocks, range(new_start, new_start + len(CHUNK)))
    report = w.build_report()  # a slow read (a loaded host) is reported too: only failures count here
    assert report is None or not (report.load_failed or report.not_blended or report.blend_error)

    assert from_ref.abs().sum() > 0
    torch.testing.assert_close(from_ref[:, :, 1], from_copy[:, :, 1], rtol=0, atol=0)  # V moves unchanged
    torch.testing.assert_close(from_ref[:, :, 0], from_copy[:, :, 0], rtol=1e-5, atol=1e-5)  # K: one rotation less
    original = kv_at(w, a_blocks, range(CHUNK.start, CHUNK.end))
    torch.testing.assert_close(from_ref[:, :, 1], original[:, :, 1], rtol=0, atol=0)


def test_two_chunk_blocks_naming_one_stored_block_read_it_once(tmp_path):
    """Chunk blocks [21, 37) and [37, 48) of prompt A both take rows of A's exact block 2: the step
    reads it once, into one buffer both take their rows from, and each gets its own V."""
    w = worker(tmp_path)
    a_blocks, b_blocks, new_start = [1, 2, 3], [8, 9, 10, 11, 12], 50
    gen = torch.Generator().manual_seed(1)
    for cache in w.caches:
        cache[a_blocks] = torch.randn((len(a_blocks), H, BS, 2 * D), generator=gen)
    exact = [store_key(b"ns", KeyKind.EXACT, bytes([i]) * 32) for i in range(3)]
    w.wait_for_save(UCMConnectorMetadata([RequestStep("a", a_blocks, 0, 3 * BS,
                                                      dumps=[BlockDump(k, i * BS, BS) for i, k in enumerate(exact)])]))
    w._reap_dumps(block=True)
    hashes = [bytes([i]) * 32 for i in range(3)]
    loads = []
    for span in (CHUNK, Span(CHUNK.end, 3 * BS)):
        at = new_start + span.start - CHUNK.start
        loads += [BlockLoad(exact[p.source[0]], p.start, len(p.rows), p.rope_delta, rows_from=p.rows.start,
                            stored_tokens=BS)
                  for p in ref_pieces(make_ref(span, hashes, BS), Span(at, at + len(span)), at)]
    assert [ld.key for ld in loads] == [exact[1], exact[2], exact[2]]
    w.start_load_kv(load_step(b_blocks, loads, new_start))
    assert w.stats.data["shared_reads"] == 1
    placed = kv_at(w, b_blocks, range(new_start, new_start + 3 * BS - CHUNK.start))
    original = kv_at(w, a_blocks, range(CHUNK.start, 3 * BS))
    torch.testing.assert_close(placed[:, :, 1], original[:, :, 1], rtol=0, atol=0)


def test_shared_reads_are_blocks_read_whole_into_the_second_buffer_under_one_key():
    from ucm.integration.vllm.connector.read_layout import read_destinations, shared_reads, whole_rows

    k1, k2 = b"k1", b"k2"
    chunks = [BlockLoad(k1, 0, 11, rows_from=5, stored_tokens=BS), BlockLoad(k2, 11, 5, stored_tokens=BS),
              BlockLoad(k2, 16, 11, rows_from=5, stored_tokens=BS), BlockLoad(k1, 27, BS)]  # the last: whole
    shared = shared_reads(chunks)
    assert shared == {2: 1}
    assert whole_rows(chunks, [BlockLoad(b"p", 0, BS)], shared) == 3 * BS
    staging, whole = torch.zeros(11 + 5 + 11 + BS, 4), torch.zeros(3 * BS, 4)
    dest, shared_too = read_destinations(chunks, [BlockLoad(b"p", 0, BS)], staging,
                                         lambda rows: whole if rows == 3 * BS else None)
    assert shared_too == shared
    assert dest[2] is dest[1] and dest[0].data_ptr() != dest[1].data_ptr() and len(dest) == 5
    assert dest[3].data_ptr() == staging[27:].data_ptr()
