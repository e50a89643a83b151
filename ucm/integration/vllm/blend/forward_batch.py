"""The rows a Blend forward runs: vLLM's scheduled rows with each blend request's region rows
inserted before its own, and the per-request Blend settings every phase reads.

vLLM gives the model no request ids: a region is matched to its request by the slot of the
request's first scheduled token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ucm.integration.vllm.blend.lora_rows import LoraRows, within
from ucm.integration.vllm.blend.passes import BlendRows
from ucm.integration.vllm.blend.rank_faults import RankFaults
from ucm.integration.vllm.blend_step import BlendStep
from ucm.sparse.blend.kv_shift import sampled_offsets
from ucm.sparse.blend.vocabulary import sample_stride


@dataclass
class ForwardBatch:
    """The rows the Blend forward runs: vLLM's scheduled rows, each blend request's region rows
    inserted before its own (a request's rows stay contiguous and in position order, as in vLLM's
    batch), with per-request Blend settings."""

    rows: BlendRows
    hidden: torch.Tensor  # [n, hidden] embeddings
    ratios: torch.Tensor  # [num_reqs] float32, 0 for requests not blending
    rules: torch.Tensor  # [num_reqs] selection code, -1 for requests not blending
    question_end: torch.Tensor  # [num_reqs] probe queries come from positions before this
    near_chunk_start: torch.Tensor  # [n] rows within the first chunk_start_tokens of their loaded chunk
    # ([n] the evenly spaced rows of each loaded chunk that estimate its KV shift, [n] the rows of the
    # requests that estimate it so: kv_shift_sample > 0)
    shift_sample: tuple[torch.Tensor, torch.Tensor]
    # ([n] chunk index of rows of kv_shift requests, else -1; [num_chunks] each chunk's kv_shift share)
    chunk_of: tuple[torch.Tensor, torch.Tensor]
    scheduled: torch.Tensor | None  # rows of vLLM's scheduled tokens, in its order; None: all rows
    num_input_rows: int  # rows of vLLM's input (padding included)


def batch_with_regions(model, step: BlendStep, fc, input_ids, positions, inputs_embeds,
                  faults: RankFaults) -> ForwardBatch:
    """Builds the batch of this step's forward: vLLM's rows plus the region rows of each blend
    request, found in vLLM's batch by the slot of its first scheduled token (the V1 runner gives
    the model no request ids)."""
    layer_names = list(fc.attn_metadata)  # one KV-cache group: one metadata object
    meta = fc.attn_metadata[layer_names[0]]
    n = int(meta.num_actual_tokens)
    device = positions.device
    slot_mapping = fc.slot_mapping[layer_names[0]][:n].long()
    qsl = meta.query_start_loc.long()
    num_reqs = qsl.shape[0] - 1
    owner = {slot: i for i, slot in enumerate(slot_mapping[qsl[:-1]].tolist())}
    regions = {}
    for region in step.regions:
        if region.first_slot not in owner:
            raise RuntimeError(f"Blend: no request of this batch starts at slot {region.first_slot}")
        regions[owner[region.first_slot]] = region
    ratios = torch.zeros(num_reqs, dtype=torch.float32, device=device)
    rules = torch.full((num_reqs,), -1, dtype=torch.long, device=device)
    question_end = torch.full((num_reqs,), torch.iinfo(torch.long).max, dtype=torch.long, device=device)
    for i, region in regions.items():
        ratios[i], rules[i], question_end[i] = region.ratio, int(region.selection), region.question_end
    num_rows = (inputs_embeds if inputs_embeds is not None else input_ids).shape[0]  # padding included
    hidden = inputs_embeds[:n] if inputs_embeds is not None else model.embed_input_ids(input_ids[:n])
    counts = qsl[1:] - qsl[:-1]
    if not any(len(r.positions) for r in regions.values()):
        segment = torch.repeat_interleave(torch.arange(num_reqs, device=device), counts)
        rows = BlendRows(fc, layer_names, step.layout, meta, positions[:n], slot_mapping, segment,
                         LoraRows.of(model, torch.arange(n, device=device)), faults)
        return ForwardBatch(rows, hidden, ratios, rules, question_end, near_chunk_start(regions, rows),
                            shift_sample(regions, rows), chunk_of(regions, rows), None, num_rows)
    lens, offset = [], 0
    region_rows, scheduled = [], []
    for i in range(num_reqs):
        m = len(regions[i].positions) if i in regions else 0
        count = int(counts[i])
        if m:
            region_rows.append(torch.arange(offset, offset + m, device=device))
        scheduled.append(torch.arange(offset + m, offset + m + count, device=device))
        offset += m + count
        lens.append(m + count)
    region_rows, scheduled = torch.cat(region_rows), torch.cat(scheduled)
    ordered = [regions[i] for i in sorted(regions) if len(regions[i].positions)]
    total = offset
    lens_t = torch.tensor(lens, device=device)
    segment = torch.repeat_interleave(torch.arange(num_reqs, device=device), lens_t)
    # Each row's request, as the row of vLLM's batch that request's LoRA mapping is read from.
    lora = LoraRows.of(model, qsl[segment])
    out_hidden = hidden.new_empty(total, hidden.shape[1])
    out_hidden[scheduled] = hidden
    with within(lora, region_rows):
        out_hidden[region_rows] = model.embed_input_ids(torch.cat([r.token_ids for r in ordered]))
    out_positions = positions.new_empty(total)
    out_positions[scheduled] = positions[:n]
    out_positions[region_rows] = torch.cat([r.positions for r in ordered]).to(positions.dtype)
    out_slots = slot_mapping.new_empty(total)
    out_slots[scheduled] = slot_mapping
    out_slots[region_rows] = torch.cat([r.slots for r in ordered])
    new_qsl = torch.zeros(num_reqs + 1, dtype=meta.query_start_loc.dtype, device=device)
    new_qsl[1:] = torch.cumsum(lens_t, 0)
    new_meta = dataclasses.replace(meta, num_actual_tokens=total, query_start_loc=new_qsl,
                                   max_query_len=int(lens_t.max()))
    rows = BlendRows(fc, layer_names, step.layout, new_meta, out_positions, out_slots, segment, lora, faults)
    return ForwardBatch(rows, out_hidden, ratios, rules, question_end, near_chunk_start(regions, rows),
                        shift_sample(regions, rows), chunk_of(regions, rows), scheduled, num_rows)


def near_chunk_start(regions: dict, b: BlendRows) -> torch.Tensor:
    """[n] bool: rows among the first `chunk_start_tokens` of their request's loaded chunks."""
    near = torch.zeros(b.positions.shape[0], dtype=torch.bool, device=b.positions.device)
    for mine, pos, at, region in _rows_in_chunks(regions, b, lambda r: r.chunk_start_tokens):
        start = region.chunk_starts[at.clamp(min=0)]
        near[mine] = (at >= 0) & (pos - start < region.chunk_start_tokens)
    return near


def shift_sample(regions: dict, b: BlendRows) -> tuple[torch.Tensor, torch.Tensor]:
    """([n] bool, [n] bool): every `sample_stride`-th row of each loaded chunk (from half a stride
    in) of the requests whose KV shift is estimated from such a sample, and all rows of those
    requests. Rows past a chunk's loaded part are not loaded rows: the forward ignores them."""
    n, device = b.positions.shape[0], b.positions.device
    sample = torch.zeros(n, dtype=torch.bool, device=device)
    sampling = torch.zeros(n, dtype=torch.bool, device=device)
    for mine, pos, at, region in _rows_in_chunks(regions, b, lambda r: r.kv_shift > 0 and r.kv_shift_sample > 0):
        offsets = torch.where(at >= 0, pos - region.chunk_starts[at.clamp(min=0)], at)
        sample[mine] = sampled_offsets(offsets, sample_stride(region.kv_shift_sample))
        sampling |= mine
    return sample, sampling


def chunk_of(regions: dict, b: BlendRows) -> tuple[torch.Tensor, torch.Tensor]:
    """([n] long, [num_chunks] float32): each row's loaded chunk, numbered across the batch, for
    requests with kv_shift on (-1 elsewhere and before a request's first loaded chunk), and each
    chunk's share (its request's kv_shift)."""
    device = b.positions.device
    chunk = torch.full((b.positions.shape[0],), -1, dtype=torch.long, device=device)
    shares = []
    for mine, _, at, region in _rows_in_chunks(regions, b, lambda r: r.kv_shift > 0):
        chunk[mine] = torch.where(at >= 0, at + len(shares), at.new_tensor(-1))
        shares += [region.kv_shift] * region.chunk_starts.numel()
    return chunk, torch.tensor(shares, dtype=torch.float32, device=device)


def _rows_in_chunks(regions: dict, b: BlendRows, wanted):
    """For each region that `wanted(region)` and that loaded chunks: (its rows mask, their
    positions, the index of the loaded chunk each row is in, -1 before the first; the region)."""
    for i, region in regions.items():
        if not wanted(region) or not region.chunk_starts.numel():
            continue
        mine = b.segment == i
        pos = b.positions[mine].long()
        yield mine, pos, torch.searchsorted(region.chunk_starts, pos, right=True) - 1, region
