"""Worker half of the UCM connector: moves KV between vLLM's paged cache and the store.

Stored blocks are layout-free and layer-major: `[num_layers, num_tokens, 2 (K, V), num_kv_heads,
head_size]` in the KV cache dtype, one store segment per layer (block_tensors.py), K at the block's
own positions (chunk-local for chunk KV), so one store serves engines with different attention
backends, a chunk can be placed at any offset, one layer can be read alone, and the chunk blocks
of a step load back to back into one staging tensor, layer by layer.
"""

from __future__ import annotations

import logging
import time

import torch

from ucm.integration.vllm.blend_step import BlendStep, RegionRows, require_blend_models
from ucm.integration.vllm.kv_layout import KVLayout, layer_index, layout_for, slots_for_positions
from ucm.sparse.blend.vocabulary import KEY_RULES, Selection
from ucm.integration.vllm.connector.background_loads import BackgroundLoads, slow_read
from ucm.integration.vllm.connector.block_tensors import new_block
from ucm.integration.vllm.connector.chunk_prefetch import ChunkPrefetches
from ucm.integration.vllm.connector.metadata import BlockDump, RequestStep, UCMConnectorMetadata, UCMWorkerReport
from ucm.integration.vllm.connector.dump_queue import DumpQueue
from ucm.integration.vllm.connector.layerwise_loads import LayerwiseLoad, read_step
from ucm.integration.vllm.connector.key_rotation import KeyRotation
from ucm.integration.vllm.connector.read_layout import num_reads, read_destinations, staged_rows
from ucm.integration.vllm.connector.staged_chunks import stage_chunks
from ucm.integration.vllm.connector.rank_agreement import PeerLoadFailed, RankAgreement, tensor_parallel_rank_and_size
from ucm.integration.vllm.connector.reused_buffers import ReusedBuffers
from ucm.integration.vllm.connector.stats import UCMConnectorStats
from ucm.integration.vllm.faults import ErrorLog, inject
from ucm.store.base import KVStoreBase
from ucm.store.keys import StoreKey, shard_key

logger = logging.getLogger(__name__)

# Attention backends whose metadata blend_forward can narrow to the selected tokens.
BLEND_BACKENDS = ("CPU_ATTN",)


class WorkerSide:
    def __init__(self, vllm_config, store: KVStoreBase, check_layer: int | None, max_blend_rows: int | None = None,
                 narrowing: tuple[tuple[int, float], ...] = (), layerwise: bool = False):
        self.vllm_config = vllm_config
        self.max_blend_rows = max_blend_rows
        self.store = store
        self.check_layer = check_layer
        self.narrowing = narrowing  # the later check layers (gradual filtering)
        # Chunk KV of Blend steps read layer group by layer group during the forward; one rank only
        # (under tensor parallelism a late fault on one rank would need the others to agree on it).
        self.layerwise = layerwise
        self._layerwise: LayerwiseLoad | None = None  # this step's reads still running
        self.block_size = vllm_config.cache_config.block_size
        self.layer_names: list[str] = []
        self.caches: list[torch.Tensor] = []
        self.layout: KVLayout | None = None
        self.token_bytes = 0  # one token's KV over every layer, known once the caches are registered
        self.stats = UCMConnectorStats()  # this interval's counts, taken by vLLM after every step
        self.totals = UCMConnectorStats()  # since start-up, logged at shutdown
        self._failed_block_ids: set[int] = set()
        # Each rank stores its own heads under its own key (shard_key): ranks never read each other's.
        self.rank, self.world = tensor_parallel_rank_and_size()
        self._agreement = RankAgreement(self.world)
        self._report = UCMWorkerReport()  # for the scheduler, after this step
        # Requests whose KV may be wrong (a failed load, a Blend region never run): nothing of theirs
        # is dumped until they finish.
        self._untrusted: set[str] = set()
        config = getattr(store, "config", None)
        self._pending = DumpQueue(store, int(getattr(config, "dump_queue_mb", 1024.0) * (1 << 20)))
        self._blend_step: BlendStep | None = None
        self._blend_requests: list[RequestStep] = []  # the requests of this step's Blend step
        self._errors = ErrorLog(logger)
        self._buffers = ReusedBuffers(2 * self.block_size)
        self._background = BackgroundLoads(store)  # exact prefixes
        self._prefetch = ChunkPrefetches(store)  # chunk blocks of queued blend requests
        # Rotations only happen for chunk KV: a store used for prefix offload alone needs no RoPE.
        self.rotation = None if check_layer is None else KeyRotation.for_model(
            vllm_config, lambda shape, dtype: self._buffers.get("rope", shape, dtype))

    # ---- set-up --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=layer_index)
        self.layer_names = names
        self.caches = [kv_caches[n] for n in names]
        ctx = self.vllm_config.compilation_config.static_forward_context
        attn = ctx[names[0]]
        model_config = self.vllm_config.model_config
        backend = attn.attn_backend.get_name()
        self.layout = layout_for(self.caches[0], backend, self.block_size, attn.num_kv_heads, attn.head_size)
        if self.check_layer is not None and backend not in BLEND_BACKENDS:
            raise ValueError(f"ucm_sparse_config.Blend: the sparse forward supports the attention backends "
                             f"{BLEND_BACKENDS}; this engine uses {backend}. Remove Blend from the config to "
                             "use the store for prefix offload only.")
        if self.check_layer is not None and not 0 <= self.check_layer < len(names):
            raise ValueError(f"Blend check layer {self.check_layer} does not exist: {model_config.model} has "
                             f"{len(names)} attention layers")
        self._token_shape = (len(names), 2, attn.num_kv_heads, attn.head_size)
        self._dtype = self.caches[0].dtype
        self.token_bytes = len(names) * 2 * attn.num_kv_heads * attn.head_size * self._dtype.itemsize
        self._device = self.caches[0].device

    def check_blend_forward(self) -> None:
        if self.check_layer is not None:
            require_blend_models(getattr(self.vllm_config.model_config, "architectures", None))

    def store_key(self, key: StoreKey) -> StoreKey:
        """The key of this rank's shard of a block."""
        return shard_key(key, self.rank, self.world)

    def block_tensor(self, num_tokens: int) -> torch.Tensor:
        return new_block(num_tokens, self._token_shape, self._dtype)

    def _staging(self, name: str, num_tokens: int) -> torch.Tensor:
        """A reused load buffer: the [tokens, layers, 2, H, D] view of layer-major storage."""
        L, *rest = self._token_shape
        return self._buffers.get(name, (L, num_tokens, *rest), self._dtype, dim=1).transpose(0, 1)

    # ---- loads ---------------------------------------------------------------------------

    def start_load_kv(self, meta: UCMConnectorMetadata) -> None:
        self._blend_step = None
        self._blend_requests = []
        if meta.prefetches:
            self._prefetch.start_all(meta.prefetches, self.store_key, self.block_tensor, self.token_bytes)
        background = [req for req in meta.requests if req.load_async]
        if background:  # read between steps; no rank waits for another over them (vLLM unions the failures)
            for req in background:
                self._start_background(req)
            meta = UCMConnectorMetadata([req for req in meta.requests if not req.load_async])
        self._agreement.begin_step()
        failed: Exception | None = None
        try:
            self._load(meta)
        except Exception as exc:  # a cache fault must not take the engine down: vLLM computes instead
            failed = exc
        if self.world > 1 and any(req.prefix_loads or req.chunk_loads or req.blend is not None
                                  for req in meta.requests):
            if not self._agreement.joined:  # the other ranks wait in the per-block agreement
                self._agreement.loaded(num_reads(meta), None)
            if self._agreement.any_failed(failed is not None) and failed is None:
                failed = PeerLoadFailed("another tensor-parallel rank's loads or placement failed")
        if failed is not None:
            self._blend_step = None
            self._end_layerwise()
            # The store's IO threads may still be writing the load buffers: never reuse them.
            self._buffers.drop("chunk_rows", "whole_blocks")
            self._fail_requests([req for req in meta.requests if req.prefix_loads or req.blend is not None],
                                "load", failed, from_prefix=True)

    def _load(self, meta: UCMConnectorMetadata) -> None:
        prefix = [(req, ld) for req in meta.requests for ld in req.prefix_loads]
        chunks = [(req, ld) for req in meta.requests for ld in req.chunk_loads]
        blends = [req for req in meta.requests if req.blend is not None]
        if not prefix and not chunks and not blends:
            return
        inject("load")
        self._blend_requests = blends
        start = time.perf_counter()
        # Loads never wait for dumps: the scheduler serves a block only once its dump is confirmed.
        chunk_lds, prefix_lds = [ld for _, ld in chunks], [ld for _, ld in prefix]
        staging = self._staging("chunk_rows", staged_rows(chunk_lds))
        destinations, shared = read_destinations(chunk_lds, prefix_lds, staging,
                                                 lambda rows: self._staging("whole_blocks", rows))
        keys = [self.store_key(ld.key) for ld in chunk_lds + prefix_lds]
        filled = self._prefetch.fill([(req.req_id, ld) for req, ld in chunks], destinations)
        self.stats.add("prefetched_blocks", len(filled))
        waited = time.perf_counter()
        # Chunk blocks of Blend steps: layer-wise, the first layer group is waited for, the rest read on.
        layered = len(chunks) if blends and self.layerwise and self.world == 1 else 0
        task, ok, read_bytes, self._layerwise = read_step(self.store, keys, destinations, filled, layered,
                                                          len(self.caches), self.check_layer, self.stats, shared)
        ok = self._agreement.loaded(len(keys), ok)
        if ok is None:
            raise PeerLoadFailed("another tensor-parallel rank's loads failed")
        wait_s = time.perf_counter() - waited
        self.stats.add("load_wait_seconds", wait_s)
        if slow_read(wait_s, bool(prefix), bool(chunks), task.timed_out, read_bytes):
            self._report.slow_read_s = max(self._report.slow_read_s, wait_s)
        if task.refused:
            self.stats.add("store_down_blocks", len(task.native_indices))
        if task.timed_out:  # IO threads may still write the load buffers: never reuse them
            self._buffers.drop("chunk_rows", "whole_blocks")
            self.stats.add("load_timeout_blocks", len(keys) - sum(ok))

        for (req, ld), buf, good in zip(prefix, destinations[len(chunks):], ok[len(chunks):]):
            if good:
                self._count_load(buf)
                self._place_exact(buf, self._slots(req, ld.start, ld.num_tokens))
            else:  # vLLM recomputes the blocks reported by get_block_ids_with_load_errors
                self.stats.add("failed_blocks")
                self._failed_block_ids.add(req.block_ids[ld.start // self.block_size])
                self._distrust(req.req_id)

        for (req, ld), buf, good in zip(chunks, destinations, ok):
            if good:
                self._count_load(buf)
            else:  # not loaded: the forward computes its tokens
                self.stats.add("failed_blocks")
                self._distrust(req.req_id)
        staged = stage_chunks(chunks, destinations, ok, staging, self._slots, self._device)
        layerwise = self._layerwise if staged is not None else None
        if blends:
            if staged is not None:
                keyed = any(Selection.parse(req.blend.selection) in KEY_RULES for req in blends)
                slot_t = staged.slots
                first = layerwise.groups[0][1] if layerwise is not None else len(self.caches)
                check_k, check_v = self._place_chunks(staged.layers(0, first), slot_t, staged.deltas, 0, keyed)
                if layerwise is not None:
                    layerwise.place = lambda a, b: self._place_chunks(staged.layers(a, b), slot_t, staged.deltas, a)
            else:  # every chunk load failed: the regions are computed in full
                slot_t = torch.zeros(0, dtype=torch.long, device=self._device)
                check_v = torch.zeros((0, *self._token_shape[2:]), dtype=self._dtype, device=self._device)
                check_k = None
            self._blend_step = BlendStep(slot_t, check_v, check_k, [self._region_rows(req) for req in blends],
                                         self.check_layer, self.layout, self.caches, self.stats,
                                         None if self.rotation is None else (self.rotation.cos_sin, self.rotation.is_neox),
                                         self.max_blend_rows, self.narrowing,
                                         None if layerwise is None else layerwise.ready)
        self.stats.add("load_seconds", elapsed := time.perf_counter() - start)
        logger.debug("loaded %d blocks in %.3fs", len(keys), elapsed)

    def _start_background(self, req: RequestStep) -> None:
        loads = req.prefix_loads
        self._background.start(req.req_id, [self.store_key(ld.key) for ld in loads],
                               [self.block_tensor(ld.num_tokens) for ld in loads],
                               [self._slots(req, ld.start, ld.num_tokens) for ld in loads],
                               [req.block_ids[ld.start // self.block_size] for ld in loads])

    def received(self) -> set[str]:
        """Requests whose exact prefix, read between steps, is in place (or failed: its failed
        blocks are reported as load errors in this same step, as vLLM requires)."""
        if not len(self._background):
            return set()
        got = self._background.poll(self._place_exact)
        self._failed_block_ids |= got.failed_block_ids
        for req_id in got.failed_req_ids:
            self._distrust(req_id)
        got.count(self.stats)
        return got.req_ids

    def _region_rows(self, req: RequestStep) -> RegionRows:
        region = req.blend
        n = region.end - region.start
        slots = self._slots(req, region.start, n + 1).to(self._device)  # and the first scheduled token's
        return RegionRows(int(slots[-1]), torch.arange(region.start, region.end, device=self._device),
                          torch.tensor(region.token_ids, dtype=torch.long, device=self._device), slots[:n],
                          region.ratio, Selection.parse(region.selection), region.question_end,
                          torch.tensor(region.chunk_starts, dtype=torch.long, device=self._device),
                          region.chunk_start_tokens, region.kv_shift, region.kv_shift_sample)

    def _count_load(self, block: torch.Tensor) -> None:
        self.stats.add("loaded_blocks")
        self.stats.add("load_bytes", block.numel() * block.element_size())

    def _place_exact(self, block: torch.Tensor, slots: torch.Tensor) -> None:
        assert self.layout is not None
        slots = slots.to(self._device)
        for layer, cache in enumerate(self.caches):
            self.layout.scatter(cache, slots, block[:, layer, 0].to(self._device), block[:, layer, 1].to(self._device))

    def _place_chunks(self, kv: torch.Tensor, slots: torch.Tensor, delta: torch.Tensor, first_layer: int = 0,
                      keep_k: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Write `kv`'s layers ([tokens, layers, 2, H, D], from `first_layer` on), K shifted in one
        rotation (in `kv`, a buffer of ours), scattered layer by layer; return the check layer's
        loaded K (None unless `keep_k`) and V (None if not among them), kept aside for the deviation
        test as the selected tokens overwrite them in the cache. Layers before the check layer are
        needed too: rows that skip them (probed requests, full reuse) attend to the loaded KV there.
        """
        assert self.layout is not None and self.check_layer is not None
        inject("rotate")
        self.rotation.shift_(kv[:, :, 0], delta)
        for j in range(kv.shape[1]):
            self.layout.scatter(self.caches[first_layer + j], slots, kv[:, j, 0].to(self._device),
                                kv[:, j, 1].to(self._device))
        check = self.check_layer - first_layer
        if not 0 <= check < kv.shape[1]:
            return None, None
        check_k = kv[:, check, 0].to(self._device, copy=True) if keep_k else None
        return check_k, kv[:, check, 1].to(self._device, copy=True)

    def _distrust(self, req_id: str) -> None:
        """A load of this request failed: the rows computed over it must never reach the store."""
        self._untrusted.add(req_id)
        self._report.load_failed.add(req_id)

    def take_blend_step(self) -> BlendStep | None:
        step, self._blend_step = self._blend_step, None
        return step

    def blend_forward_failed(self, exc: BaseException) -> None:
        """The Blend forward of this step raised: its requests are recomputed by vLLM."""
        self._fail_requests(self._blend_requests, "blend forward", exc, from_prefix=False)

    def _fail_requests(self, requests: list[RequestStep], stage: str, exc: BaseException, from_prefix: bool) -> None:
        """Hands `requests` back to vLLM's own computation after a fault in the cache path.

        A block of each is reported as a load error (the first of its exact prefix loads when
        those may be unfinished, `from_prefix`, else the first of its Blend region, which starts
        on a block boundary): vLLM's scheduler truncates the
        request's computed tokens there, discards what it sampled this step and computes the
        rest itself (kv_load_failure_policy "recompute"). Nothing of these requests is stored
        afterwards, and each reports `fallback: "blend_error"`.
        """
        self._errors.error(stage, exc, f"{len(requests)} request(s) of this step are computed by vLLM instead")
        self.stats.add("blend_errors")
        for req in requests:
            first = req.prefix_loads[0].start if from_prefix and req.prefix_loads else req.blend.start
            self._failed_block_ids.add(req.block_ids[first // self.block_size])
            self._untrusted.add(req.req_id)
            self._report.blend_error.add(req.req_id)

    def forget(self, finished_req_ids) -> None:
        self._untrusted.difference_update(finished_req_ids)
        self._prefetch.forget(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    # ---- dumps ---------------------------------------------------------------------------

    def _end_layerwise(self) -> None:
        """Ends the step's layer-wise reads; buffers a read past its deadline may write are dropped."""
        running, self._layerwise = self._layerwise, None
        if running is not None and not running.finish():
            self._buffers.drop("chunk_rows", "whole_blocks")

    def wait_for_save(self, meta: UCMConnectorMetadata) -> None:
        self._end_layerwise()
        try:
            self._save(meta)
        except Exception as exc:  # nothing of this step is stored; the engine goes on
            self._errors.error("dump", exc, "this step's blocks are not stored")
            self.stats.add("dump_errors")
            self._refuse([d for req in meta.requests for d in req.dumps])

    def _save(self, meta: UCMConnectorMetadata) -> None:
        if self._blend_step is not None:  # loaded for a Blend forward that never took it
            self._blend_step = None
            unrun = {req.req_id for req in meta.requests if req.blend is not None}
            logger.error("the model forward did not run the Blend region of requests %s: nothing of this step "
                         "is stored (is the model class the Blend one?)", sorted(unrun))
            self._report.not_blended |= unrun
            self._untrusted |= unrun
            self._refuse([d for req in meta.requests for d in req.dumps])
            return
        self._refuse([d for req in meta.requests if req.req_id in self._untrusted for d in req.dumps])
        dumps = [(req, d) for req in meta.requests if req.req_id not in self._untrusted for d in req.dumps]
        if dumps:
            self._pending.submit(dumps, self._gather, self.store_key, self.token_bytes, self._report, self.stats)

    def _refuse(self, dumps: list[BlockDump]) -> None:
        if dumps:
            self.stats.add("dumps_refused", len(dumps))
            self._report.not_stored.update(d.key for d in dumps)

    def build_report(self) -> UCMWorkerReport | None:
        """This step's report for the scheduler (dumps the store answered since the last one).
        vLLM asks for it at the end of every step, forward or not: finished dumps are reaped here."""
        self._reap_dumps(block=False)
        for req_id in self._prefetch.poll():
            self._report.prefetched[req_id] = 1
        report, self._report = self._report, UCMWorkerReport()
        report.store_down_s = self.store.down_for_s()
        return None if report.is_empty() else report

    def _gather(self, req: RequestStep, dump: BlockDump) -> torch.Tensor:
        assert self.layout is not None
        slots = self._slots(req, dump.start, dump.num_tokens).to(self._device)
        out = self.block_tensor(dump.num_tokens)
        self.layout.gather_layers_into(self.caches, slots, out)
        if dump.rope_delta:
            delta = torch.full((dump.num_tokens,), -dump.rope_delta, dtype=torch.long)
            self.rotation.shift_(out[:, :, 0], delta)
        return out

    def _reap_dumps(self, block: bool) -> None:
        self._pending.reap(self._report, self.stats, block)

    def take_stats(self) -> UCMConnectorStats | None:
        taken = self.stats.take()
        if taken is not None:
            self.totals.aggregate(taken)
        return taken

    def shutdown(self) -> None:
        self._end_layerwise()
        self._background.drop()
        self._reap_dumps(block=True)
        self.totals.aggregate(self.stats)
        logger.info("UCM worker totals: %s", self.totals.reduce())

    # ---- helpers -------------------------------------------------------------------------

    def _slots(self, req: RequestStep, start: int, num_tokens: int) -> torch.Tensor:
        positions = torch.arange(start, start + num_tokens, dtype=torch.long)
        return slots_for_positions(torch.tensor(req.block_ids, dtype=torch.long), positions, self.block_size)

