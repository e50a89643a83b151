"""In-process LRU of blocks bounded by bytes.

Used as the DRAM tier in front of UcmNfsStore (hot blocks skip the filesystem entirely), and
usable on its own as a KVStoreBase for single-process setups and tests. Blocks are held as
immutable `bytes` copies, so a caller reusing its buffers cannot change what is stored.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ucm.store.base import BlockMeta, Buffer, KVStoreBase, StoreStats, Task, byte_view, validate_keys


@dataclass(frozen=True)
class _Block:
    data: bytes
    token_count: int


class DramStore(KVStoreBase):
    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._used = 0
        self._lock = threading.Lock()
        self._stats = StoreStats()

    @property
    def used_bytes(self) -> int:
        return self._used

    # -- tier API (no stats; the owning store counts) ------------------------------------
    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def get_into(self, key: bytes, dest: memoryview) -> bool:
        """Copy a block into `dest` (a flat byte view); False if absent or of another length."""
        with self._lock:
            block = self._blocks.get(key)
            if block is None or len(block.data) != len(dest):
                return False
            self._blocks.move_to_end(key)
        dest[:] = block.data
        return True

    def get_segments_into(self, key: bytes, dests: list[memoryview], first: int, total: int) -> bool:
        """Copy segments `first...` of a block of `total` equal segments into `dests`; False if
        absent or of another length."""
        with self._lock:
            block = self._blocks.get(key)
            seg = len(dests[0]) if dests else 0
            if (block is None or not seg or first + len(dests) > total or len(block.data) != seg * total
                    or any(len(d) != seg for d in dests)):
                return False
            self._blocks.move_to_end(key)
        for j, dest in enumerate(dests):
            at = (first + j) * seg
            dest[:] = block.data[at:at + seg]
        return True

    def put(self, key: bytes, src: memoryview, token_count: int) -> int:
        """Store a copy; returns how many blocks were evicted to make room."""
        size = len(src)
        if size > self.capacity_bytes:
            return 0
        block = _Block(bytes(src), token_count)
        evicted = 0
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self._used -= len(old.data)
            while self._blocks and self._used + size > self.capacity_bytes:
                _, victim = self._blocks.popitem(last=False)
                self._used -= len(victim.data)
                evicted += 1
            self._blocks[key] = block
            self._used += size
        return evicted

    def meta(self, key: bytes) -> BlockMeta | None:
        block = self._blocks.get(key)
        return None if block is None else BlockMeta(len(block.data), block.token_count)

    # -- KVStoreBase: everything completes synchronously -------------------------------
    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        keys = validate_keys(keys)
        found = [k in self._blocks for k in keys]
        with self._lock:
            self._stats.count_lookup(found)
        return found

    def load(self, keys: Sequence[bytes], destinations: Sequence[Buffer]) -> Task:
        keys = validate_keys(keys)
        if len(destinations) != len(keys):
            raise ValueError(f"load: {len(keys)} keys but {len(destinations)} destinations")
        views = [byte_view(d, writable=True) for d in destinations]
        t0 = time.perf_counter()
        results = [self.get_into(k, v) for k, v in zip(keys, views)]
        return self._loaded(keys, results, [len(v) for v in views], t0)

    def load_segments(self, keys: Sequence[bytes], destinations: Sequence[Sequence[Buffer]], first: int,
                      total: int) -> Task:
        keys = validate_keys(keys)
        if len(destinations) != len(keys):
            raise ValueError(f"load_segments: {len(keys)} keys but {len(destinations)} destination lists")
        views = [[byte_view(d, writable=True) for d in parts] for parts in destinations]
        t0 = time.perf_counter()
        results = [self.get_segments_into(k, v, first, total) for k, v in zip(keys, views)]
        return self._loaded(keys, results, [sum(len(d) for d in v) for v in views], t0)

    def _loaded(self, keys: list[bytes], results: list[bool], sizes: list[int], t0: float) -> Task:
        with self._lock:
            ok = sum(results)
            self._stats.load_blocks += ok
            self._stats.dram_hits += ok
            self._stats.load_bytes += sum(n for n, r in zip(sizes, results) if r)
            self._stats.load_errors += len(keys) - ok
            self._stats.load_seconds += time.perf_counter() - t0
        return Task("load", keys, results=results)

    def dump(self, keys: Sequence[bytes], sources: Sequence[Buffer], token_counts: Sequence[int],
             segments: int = 1) -> Task:
        keys = validate_keys(keys)
        if not len(keys) == len(sources) == len(token_counts):
            raise ValueError(f"dump: {len(keys)} keys, {len(sources)} sources, {len(token_counts)} token_counts")
        t0 = time.perf_counter()
        results = []
        for key, src, tokens in zip(keys, sources, token_counts):
            view = byte_view(src)
            if len(view) > self.capacity_bytes:
                results.append(False)
                continue
            evicted = self.put(key, view, int(tokens))
            results.append(True)
            with self._lock:
                self._stats.evictions += evicted
                self._stats.dump_blocks += 1
                self._stats.dump_bytes += len(view)
        with self._lock:
            self._stats.dump_errors += results.count(False)
            self._stats.dump_seconds += time.perf_counter() - t0
        return Task("dump", keys, results=results)

    def wait(self, task: Task, timeout_s: float | None = None) -> list[bool]:
        assert task.results is not None
        return list(task.results)

    def check(self, task: Task) -> bool:
        return True

    def stats(self) -> StoreStats:
        with self._lock:
            return self._stats.copy()

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._used = 0

    def read_meta(self, keys: Sequence[bytes]) -> list[BlockMeta | None]:
        return [self.meta(k) for k in validate_keys(keys)]
