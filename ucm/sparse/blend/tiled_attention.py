"""Exact causal attention for queries at scattered positions of one sequence, tiled.

Blend recomputes a few hundred tokens spread over a long prompt, mostly in runs of one to three
consecutive positions. Given one pseudo-request per run, a paged-attention kernel re-reads the
request's whole K/V for every short run and multiplies it with a handful of query rows. Here the
sorted queries are cut into tiles; each tile is one GEMM against the keys up to its last
position, and only the causal tail of the tile (keys between its first and last query) is
masked: faster than vLLM's CPU kernel on short runs, whose per-run setup dominates (docs/research.md).
Beside these torch tiles long runs stay with that kernel (see sparse_attention.py).

`paged_causal_attention` is the same computation in C++ (csrc/paged_attention.cpp): it reads K/V
pages in place and keeps each page's scores in cache with an online softmax, instead of four
elementwise passes over a score buffer of tile x sequence. It needs AVX-512F or AVX2 + FMA and
float32 or bfloat16 pages (vLLM's vec layout, or for bfloat16 its AMX tiles), computing in
float32; on CPUs with AVX512-BF16 bfloat16 pages use bfloat16 dot products, and on CPUs with AMX
AMX pages use tile multiplies (`NATIVE_ISAS` lists the variants this CPU runs, best first). The torch path here is the fallback and the reference.
`paged_attention_mass` reads the same pages for the query probe's attention mass
(query_probe.attention_mass) on AVX-512 CPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ucm.cpus import other_cpus

DEFAULT_TILE = 32  # queries per tile; the speed is flat around it

try:
    from ucm.sparse.blend import _attention as _native
except ImportError:  # not built (e.g. a source checkout without `pip install -e .`)
    _native = None


@dataclass
class Tile:
    start: int  # query rows [start, end)
    end: int
    lo: int  # position of the tile's first query: keys < lo are visible to every row
    hi: int  # last position + 1: keys >= hi are visible to none
    tail_hidden: torch.Tensor | None  # [(end - start) * group, hi - lo] bool, True = key after query


@dataclass
class TilePlan:
    """Tiles of one sequence's queries, built once and reused by every layer."""

    tiles: list[Tile]
    num_queries: int
    group: int  # query heads per KV head
    max_keys: int

    @classmethod
    def build(cls, q_pos: torch.Tensor, group: int, tile: int | None = None) -> TilePlan:
        """``q_pos``: ``[n]`` positions, non-decreasing (the rows of one request)."""
        if q_pos.dim() != 1:
            raise ValueError(f"q_pos must be 1-D, got {tuple(q_pos.shape)}")
        tile = DEFAULT_TILE if tile is None else tile
        if tile <= 0 or group <= 0:
            raise ValueError("tile and group must be positive")
        pos = q_pos.long()
        if pos.numel() > 1 and bool((pos[1:] < pos[:-1]).any()):
            raise ValueError("q_pos must be sorted (non-decreasing)")
        host = pos.tolist()
        tiles = []
        for start in range(0, len(host), tile):
            end = min(start + tile, len(host))
            lo, hi = host[start], host[end - 1] + 1
            hidden = None
            if hi - lo > 1:
                keys = torch.arange(lo, hi, device=pos.device)
                hidden = (keys[None, :] > pos[start:end, None]).repeat_interleave(group, 0)
            tiles.append(Tile(start, end, lo, hi, hidden))
        return cls(tiles, len(host), group, host[-1] + 1 if host else 0)


def tiled_causal_attention(
    q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, plan: TilePlan, scale: float
) -> torch.Tensor:
    """Query ``i`` attends to keys ``0 .. q_pos[i]`` of one sequence.

    ``q``: ``[n, Hq, D]`` in ``plan`` order; ``k_t``: ``[Hk, D, S]`` (K transposed, head-major,
    ``S >= plan.max_keys``); ``v``: ``[Hk, S, D]``. Query head ``h`` uses KV head ``h // group``
    (vLLM's GQA order). Computes in float32; returns ``[n, Hq, D]`` in ``q``'s dtype.
    """
    n, hq, d = q.shape
    hk, g = k_t.shape[0], plan.group
    if n != plan.num_queries or hq != hk * g:
        raise ValueError(f"q {tuple(q.shape)} does not match the plan ({plan.num_queries} queries, "
                         f"{hk} KV heads x group {g})")
    if k_t.shape[2] < plan.max_keys or v.shape[1] < plan.max_keys:
        raise ValueError(f"{plan.max_keys} keys needed, got {k_t.shape[2]}")
    # Rows of one KV head's query group side by side: [Hk, n * g, D], so a tile is a row slice.
    qg = (q.float() * scale).view(n, hk, g, d).transpose(0, 1).reshape(hk, n * g, d)
    k_t, v = k_t.float(), v.float()
    out = torch.empty(hk, n * g, d, dtype=torch.float32, device=q.device)
    rows_max = max((t.end - t.start for t in plan.tiles), default=0) * g
    scores = torch.empty(hk * rows_max * plan.max_keys, dtype=torch.float32, device=q.device)
    for t in plan.tiles:
        r0, r1 = t.start * g, t.end * g
        s = scores[: hk * (r1 - r0) * t.hi].view(hk, r1 - r0, t.hi)
        torch.bmm(qg[:, r0:r1], k_t[:, :, : t.hi], out=s)
        if t.tail_hidden is not None:
            s[:, :, t.lo:].masked_fill_(t.tail_hidden, float("-inf"))
        s.sub_(s.amax(-1, keepdim=True)).exp_()  # in place: no second score-sized buffer
        denom = s.sum(-1, keepdim=True)
        out[:, r0:r1] = torch.bmm(s, v[:, : t.hi]).div_(denom)
    return out.view(hk, n, g, d).transpose(0, 1).reshape(n, hq, d).to(q.dtype)


# The native kernel's variants this CPU runs, best first: "amx" (bfloat16 AMX pages through tile
# multiplies; other pages run "avx512"), "avx512_bf16" (bfloat16 pages with bfloat16 dot products;
# float32 pages run "avx512"), "avx512", "avx2".
NATIVE_ISAS = () if _native is None else tuple(
    name for code in _native.isas()
    for name, value in (("amx", _native.AMX), ("avx512_bf16", _native.AVX512_BF16), ("avx512", _native.AVX512),
                        ("avx2", _native.AVX2))
    if code == value)

# Page formats of the native kernel: (page dtype, vLLM CPU attention ISA family) -> its code.
PAGE_FORMATS = {} if _native is None else {
    (torch.float32, "vec"): _native.F32, (torch.bfloat16, "vec"): _native.BF16, (torch.bfloat16, "amx"): _native.BF16_AMX}


def native_supported(dtype: torch.dtype, head_dim: int, page_size: int, device: torch.device | str = "cpu",
                     page_format: str = "vec") -> bool:
    """Whether `paged_causal_attention` can run: built, CPU with AVX-512F or AVX2, D 64/128, pages of
    ``dtype`` in ``page_format`` ("vec": vLLM's vec/vec16 layout; "amx": its AMX tiles)."""
    return (_native is not None and torch.device(device).type == "cpu" and (dtype, page_format) in PAGE_FORMATS
            and bool(_native.supports(head_dim, page_size)))


def paged_causal_attention(q: torch.Tensor, q_pos: torch.Tensor, pages: torch.Tensor, page_table: torch.Tensor,
                           scale: float, tile: int | None = None, page_format: str = "vec",
                           isa: str | None = None) -> torch.Tensor:
    """Query ``i`` attends to keys ``0 .. q_pos[i]`` of one sequence, read from its pages in place.

    ``q``: ``[n, Hq, D]``; ``q_pos``: ``[n]`` non-decreasing; ``pages``: ``[num_pages, Hk,
    2 * P * D]`` as vLLM's CPU attention stores them: with ``page_format="vec"`` (float32 or
    bfloat16) each (page, head) holds K transposed ``[D, P]`` then V ``[P, D]``; with ``"amx"``
    (bfloat16) K then V in VNNI tiles (see csrc/paged_attention.cpp). ``page_table``: the
    sequence's page ids in key order. GQA as in ``tiled_causal_attention``. Computes in float32
    (the ``amx`` and ``avx512_bf16`` variants, the default where the CPU has them, round the
    queries and the softmax weights of bfloat16 pages to bfloat16: ``amx`` on AMX pages only);
    returns ``[n, Hq, D]`` in ``q``'s dtype.
    ``isa``: one of `NATIVE_ISAS` (default: the first).
    """
    _check_native_args(q, pages, page_format, "paged attention", native_supported)
    if isa is not None and isa not in NATIVE_ISAS:
        raise ValueError(f"isa must be one of {NATIVE_ISAS} on this CPU, got {isa!r}")
    q32, pos, table, needed = _native_inputs(q, q_pos, pages, page_table)
    n, hq, d = q.shape
    out = torch.empty_like(q32)
    if n == 0:
        return out.to(q.dtype)
    hk, page_size = pages.shape[1], pages.shape[2] // (2 * d)
    _native.paged_causal_attention(
        q32.data_ptr(), pos.data_ptr(), n, pages.data_ptr(), PAGE_FORMATS[(pages.dtype, page_format)],
        pages.stride(0), pages.stride(1), table.data_ptr(), needed, hk, hq // hk, d, page_size, float(scale),
        out.data_ptr(), DEFAULT_TILE if tile is None else tile, torch.get_num_threads(), _helper_cpus(),
        0 if isa is None else getattr(_native, isa.upper()))
    return out.to(q.dtype)


def native_mass_supported(dtype: torch.dtype, head_dim: int, page_size: int, device: torch.device | str = "cpu",
                          page_format: str = "vec") -> bool:
    """Whether `paged_attention_mass` can run: `native_supported` and AVX-512F."""
    return (native_supported(dtype, head_dim, page_size, device, page_format)
            and hasattr(_native, "mass_supported") and bool(_native.mass_supported(head_dim, page_size)))


def paged_attention_mass(q: torch.Tensor, q_pos: torch.Tensor, pages: torch.Tensor, page_table: torch.Tensor,
                         scale: float, page_format: str = "vec", weigh_by_values: bool = False) -> torch.Tensor:
    """`query_probe.attention_mass` over one sequence's pages in place: the attention probability
    each key ``0 .. q_pos[-1]`` receives from queries ``q`` (query ``i`` sees keys ``0 ..
    q_pos[i]``), summed over queries and heads, each KV head's share times the key's V norm there
    with `weigh_by_values`. ``[q_pos[-1] + 1]`` float32. Arguments as `paged_causal_attention`;
    bfloat16 pages are scored with bfloat16 dot products where the CPU has them."""
    _check_native_args(q, pages, page_format, "attention mass", native_mass_supported)
    q32, pos, table, needed = _native_inputs(q, q_pos, pages, page_table)
    n, hq, d = q.shape
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=q.device)
    hk, page_size = pages.shape[1], pages.shape[2] // (2 * d)
    per_head = torch.empty(hk, int(pos[-1]) + 1, dtype=torch.float32, device=q.device)
    _native.paged_attention_mass(
        q32.data_ptr(), pos.data_ptr(), n, pages.data_ptr(), PAGE_FORMATS[(pages.dtype, page_format)],
        pages.stride(0), pages.stride(1), table.data_ptr(), needed, hk, hq // hk, d, page_size, float(scale),
        bool(weigh_by_values), per_head.data_ptr(), torch.get_num_threads(), _helper_cpus())
    return per_head.sum(0)


def _check_native_args(q: torch.Tensor, pages: torch.Tensor, page_format: str, what: str, supported) -> None:
    """Raises, naming the problem, unless the shapes fit and `supported` (the entry point's check) holds."""
    if q.dim() != 3 or pages.dim() != 3:
        raise ValueError(f"q must be [n, Hq, D] and pages [num_pages, Hk, 2*P*D]; got {tuple(q.shape)}, "
                         f"{tuple(pages.shape)}")
    n, hq, d = q.shape
    hk = pages.shape[1]
    if hq % hk or pages.shape[2] % (2 * d):
        raise ValueError(f"q {tuple(q.shape)} does not fit pages {tuple(pages.shape)}")
    page_size = pages.shape[2] // (2 * d)
    if not supported(pages.dtype, d, page_size, pages.device, page_format) or q.device != pages.device:
        raise RuntimeError(f"native {what} unavailable for {page_format!r} pages of {pages.dtype}, "
                           f"head_dim {d}, page size {page_size} (see {supported.__name__})")
    if not pages.is_contiguous():
        raise ValueError("pages must be contiguous")


def _native_inputs(q: torch.Tensor, q_pos: torch.Tensor, pages: torch.Tensor, page_table: torch.Tensor):
    """float32 queries, positions and the page ids the positions need, checked: ``(q32, pos, table,
    needed)``."""
    n, _, d = q.shape
    page_size = pages.shape[2] // (2 * d)
    q32 = q.to(torch.float32).contiguous()
    pos = q_pos.to(torch.long).contiguous()
    table = page_table.to(torch.long).contiguous()
    if pos.shape != (n,):
        raise ValueError(f"q_pos must be [{n}], got {tuple(q_pos.shape)}")
    if n == 0:
        return q32, pos, table, 0
    if bool((pos[1:] < pos[:-1]).any()) or int(pos[0]) < 0:
        raise ValueError("q_pos must be sorted (non-decreasing) and non-negative")
    needed = int(pos[-1]) // page_size + 1
    if table.numel() < needed:
        raise ValueError(f"page_table has {table.numel()} pages; position {int(pos[-1])} needs {needed}")
    table = table[:needed]
    if int(table.min()) < 0 or int(table.max()) >= pages.shape[0]:
        raise ValueError(f"page_table names pages outside [0, {pages.shape[0]})")
    return q32, pos, table, needed


_HELPER_CPUS: dict[tuple[int, frozenset], list[int]] = {}


def _helper_cpus() -> list[int]:
    """Cores for the kernel's helper threads: those of this process's other threads.

    A helper started from vLLM's bound main thread would inherit its core and halve the kernel's
    speed (see ucm/cpus.py). Empty (no pinning) where the caller is not bound to fewer cores than
    the process uses.
    """
    if not hasattr(os, "sched_getaffinity"):
        return []
    mine = frozenset(os.sched_getaffinity(0))
    key = (os.getpid(), mine)
    if key not in _HELPER_CPUS:
        _HELPER_CPUS[key] = sorted(other_cpus())
    return _HELPER_CPUS[key]


def gather_page_runs(caches: list[torch.Tensor], runs: list[tuple[int, int, int, int]], out: torch.Tensor,
                     page_size: int, page_format: str = "vec") -> bool:
    """Copies the K/V of runs of tokens out of every layer's pages into ``out`` (``[n, layers, 2,
    H, D]``, any strides over its first two dims: the store's layer-major block seen token by token,
    ``.transpose(0, 1)`` of ``[layers, n, 2, H, D]``): ``out[i:i+n, layer]`` from tokens ``o:o+n`` of
    page ``p``, for each run ``(i, p, o, n)``. Pages as `paged_causal_attention` reads them, each
    cache ``[num_pages, H, page_size, 2 * D]``. False (nothing copied) where the native kernel is
    not built or the tensors do not fit it; the caller copies then."""
    if _native is None or not hasattr(_native, "gather_page_runs") or not caches or not runs:
        return False
    dtype = caches[0].dtype
    if ((dtype, page_format) not in PAGE_FORMATS or out.dtype != dtype or out.device.type != "cpu"
            or out.dim() != 5 or out.shape[1] != len(caches)):
        return False
    h, d = out.shape[3], out.shape[4]
    if out.stride()[2:] != (h * d, d, 1):  # each token's K and V of a layer side by side
        return False
    if any(c.dtype != dtype or not c.is_contiguous() or c.device.type != "cpu"
           or tuple(c.shape[1:]) != (h, page_size, 2 * d) for c in caches):
        return False
    if page_format == "amx" and (page_size % 32 or d % 32):
        return False
    table = torch.tensor(runs, dtype=torch.long).reshape(-1, 4)
    if int(table[:, 0].add(table[:, 3]).max()) > out.shape[0] or int(table[:, 1].max()) >= caches[0].shape[0]:
        raise ValueError("gather_page_runs: a run falls outside out or the pages")
    _native.gather_page_runs([c.data_ptr() for c in caches], table.data_ptr(), table.shape[0],
                             PAGE_FORMATS[(dtype, page_format)], dtype.itemsize, h * 2 * page_size * d,
                             2 * page_size * d, h, d, page_size, out.data_ptr(), out.stride(0), out.stride(1),
                             torch.get_num_threads(), _helper_cpus())
    return True
