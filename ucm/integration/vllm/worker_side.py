"""Worker half of the UCM connector: moves KV between vLLM's paged cache and the store.

Stored blocks are layout-free: `[num_layers, 2 (K, V), num_tokens, num_kv_heads, head_size]` in
the KV cache dtype, K at the block's own positions (chunk-local for chunk KV), so one store serves
engines with different attention backends and a chunk can be placed at any offset.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field

import torch

from ucm.integration.vllm.kv_layout import KVLayout, layout_for, slots_for_positions
from ucm.integration.vllm.metadata import BlockDump, BlockLoad, RequestStep, UCMConnectorMetadata
from ucm.sparse.blend.rope import check_rope_supports_delta, rotate_keys
from ucm.store.base import KVStoreBase, Task

logger = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def layer_index(name: str) -> int:
    m = _LAYER_INDEX.search(name)
    if m is None:
        raise ValueError(f"cannot find the layer index in attention layer name {name!r}")
    return int(m.group(1))


@dataclass
class BlendStep:
    """What the Blend forward of this step needs from the loads (handed over once, then cleared)."""

    loaded_slots: torch.Tensor  # [n] slots whose KV (layers after the check layer) was loaded
    check_k: torch.Tensor  # [n, kv_heads, head_size] loaded, shifted K of the check layer
    check_layer: int
    ratio: float
    layout: KVLayout
    check_cache: torch.Tensor  # the check layer's paged KV cache, holding fresh K after that layer ran


@dataclass
class TransferStats:
    prefix_blocks_loaded: int = 0
    chunk_blocks_loaded: int = 0
    chunk_tokens_loaded: int = 0
    blocks_failed: int = 0
    blocks_dumped: int = 0
    load_seconds: float = 0.0


@dataclass
class _PendingDump:
    task: Task
    buffers: list[torch.Tensor] = field(default_factory=list)  # kept alive until the store is done


class WorkerSide:
    def __init__(self, vllm_config, store: KVStoreBase, check_layer: int | None, ratio: float):
        self.vllm_config = vllm_config
        self.store = store
        self.check_layer = check_layer
        self.ratio = ratio
        self.block_size = vllm_config.cache_config.block_size
        self.layer_names: list[str] = []
        self.caches: list[torch.Tensor] = []
        self.layout: KVLayout | None = None
        self.stats = TransferStats()
        self._pending: list[_PendingDump] = []
        self._failed_block_ids: set[int] = set()
        self._blend_step: BlendStep | None = None
        self._cos_sin, self._is_neox, self._rotary_dim = self._build_rope(vllm_config)

    # ---- set-up --------------------------------------------------------------------------

    @staticmethod
    def _build_rope(vllm_config):
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope

        hf = vllm_config.model_config.hf_text_config
        rope_parameters = getattr(hf, "rope_parameters", None)
        check_rope_supports_delta(rope_parameters)
        head_size = vllm_config.model_config.get_head_size()
        with set_current_vllm_config(vllm_config):
            rope = get_rope(head_size, max_position=vllm_config.model_config.max_model_len,
                            rope_parameters=rope_parameters, is_neox_style=True, dtype=torch.float32)
        return rope.cos_sin_cache.float(), rope.is_neox_style, rope.rotary_dim

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=layer_index)
        self.layer_names = names
        self.caches = [kv_caches[n] for n in names]
        ctx = self.vllm_config.compilation_config.static_forward_context
        attn = ctx[names[0]]
        model_config = self.vllm_config.model_config
        self.layout = layout_for(self.caches[0], attn.attn_backend.get_name(), self.block_size,
                                 attn.num_kv_heads, attn.head_size)
        if self.check_layer is not None and not 0 <= self.check_layer < len(names):
            raise ValueError(f"Blend check layer {self.check_layer} does not exist: {model_config.model} has "
                             f"{len(names)} attention layers")
        self._token_shape = (len(names), 2, attn.num_kv_heads, attn.head_size)
        self._dtype = self.caches[0].dtype
        self._device = self.caches[0].device

    def block_tensor(self, num_tokens: int) -> torch.Tensor:
        L, two, H, D = self._token_shape
        return torch.empty((L, two, num_tokens, H, D), dtype=self._dtype, device="cpu")

    # ---- loads ---------------------------------------------------------------------------

    def start_load_kv(self, meta: UCMConnectorMetadata) -> None:
        self._blend_step = None
        self._reap_dumps(block=False)
        loads = [(req, ld, False) for req in meta.requests for ld in req.prefix_loads]
        loads += [(req, ld, True) for req in meta.requests for ld in req.chunk_loads]
        if not loads:
            return
        start = time.perf_counter()
        buffers = [self.block_tensor(ld.num_tokens) for _, ld, _ in loads]
        task = self.store.load([ld.key for _, ld, _ in loads], [_bytes_view(b) for b in buffers])
        ok = self.store.wait(task)
        check_slots, check_k = [], []
        for (req, ld, is_chunk), buf, good in zip(loads, buffers, ok):
            if not good:
                self.stats.blocks_failed += 1
                if not is_chunk:  # vLLM recomputes blocks reported here; chunk tokens are computed anyway
                    self._failed_block_ids.add(req.block_ids[ld.start // self.block_size])
                continue
            slots = self._slots(req, ld.start + ld.skip, ld.num_tokens - ld.skip)
            if is_chunk:
                self.stats.chunk_blocks_loaded += 1
                self.stats.chunk_tokens_loaded += len(slots)
                check_slots.append(slots)
                check_k.append(self._place_chunk(buf[:, :, ld.skip:], slots, ld.rope_delta))
            else:
                self.stats.prefix_blocks_loaded += 1
                self._place_exact(buf, slots)
        self.stats.load_seconds += time.perf_counter() - start
        if check_slots:
            self._blend_step = BlendStep(torch.cat(check_slots).to(self._device), torch.cat(check_k),
                                         self.check_layer, self.ratio, self.layout,
                                         self.caches[self.check_layer])

    def _place_exact(self, block: torch.Tensor, slots: torch.Tensor) -> None:
        assert self.layout is not None
        slots = slots.to(self._device)
        for layer, cache in enumerate(self.caches):
            self.layout.scatter(cache, slots, block[layer, 0].to(self._device), block[layer, 1].to(self._device))

    def _place_chunk(self, block: torch.Tensor, slots: torch.Tensor, rope_delta: int) -> torch.Tensor:
        """Write the layers after the check layer, K shifted; return the check layer's shifted K.

        The forward recomputes every layer up to the check layer for all scheduled tokens, so
        only later layers need loaded KV; the check layer's K is kept aside for the deviation
        test because the forward overwrites it in the cache.
        """
        assert self.layout is not None and self.check_layer is not None
        slots = slots.to(self._device)
        delta = torch.full((slots.shape[0],), rope_delta, dtype=torch.long)
        check_k = None
        for layer in range(self.check_layer, len(self.caches)):
            k = block[layer, 0]
            if rope_delta:
                k = rotate_keys(k, delta, self._cos_sin, self._is_neox, self._rotary_dim)
            k = k.to(self._device)
            if layer == self.check_layer:
                check_k = k
                continue
            self.layout.scatter(self.caches[layer], slots, k, block[layer, 1].to(self._device))
        return check_k

    def take_blend_step(self) -> BlendStep | None:
        step, self._blend_step = self._blend_step, None
        return step

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    # ---- dumps ---------------------------------------------------------------------------

    def wait_for_save(self, meta: UCMConnectorMetadata) -> None:
        dumps = [(req, d) for req in meta.requests for d in req.dumps]
        if not dumps:
            return
        buffers = [self._gather(req, d) for req, d in dumps]
        task = self.store.dump([d.key for _, d in dumps], [_bytes_view(b) for b in buffers],
                               [d.num_tokens for _, d in dumps])
        self._pending.append(_PendingDump(task, buffers))
        self.stats.blocks_dumped += len(dumps)

    def _gather(self, req: RequestStep, dump: BlockDump) -> torch.Tensor:
        assert self.layout is not None
        slots = self._slots(req, dump.start, dump.num_tokens).to(self._device)
        out = self.block_tensor(dump.num_tokens)
        delta = torch.full((dump.num_tokens,), -dump.rope_delta, dtype=torch.long) if dump.rope_delta else None
        for layer, cache in enumerate(self.caches):
            k, v = self.layout.gather(cache, slots)
            if delta is not None:
                k = rotate_keys(k, delta, self._cos_sin, self._is_neox, self._rotary_dim)
            out[layer, 0].copy_(k)
            out[layer, 1].copy_(v)
        return out

    def _reap_dumps(self, block: bool) -> None:
        still = []
        for p in self._pending:
            if block or self.store.check(p.task):
                ok = self.store.wait(p.task)
                failed = len(ok) - sum(ok)
                if failed:
                    logger.warning("%d of %d KV blocks could not be stored (see store statistics)", failed, len(ok))
            else:
                still.append(p)
        self._pending = still

    def shutdown(self) -> None:
        self._reap_dumps(block=True)

    # ---- helpers -------------------------------------------------------------------------

    def _slots(self, req: RequestStep, start: int, num_tokens: int) -> torch.Tensor:
        positions = torch.arange(start, start + num_tokens, dtype=torch.long)
        return slots_for_positions(torch.tensor(req.block_ids, dtype=torch.long), positions, self.block_size)


def _bytes_view(t: torch.Tensor):
    """A writable uint8 numpy view of a contiguous CPU tensor (bf16 has no numpy dtype)."""
    return t.view(torch.uint8).numpy().reshape(-1)
