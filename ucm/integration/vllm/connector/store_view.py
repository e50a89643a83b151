"""The scheduler's view of the shared store: lookups under their deadlines, the dumps this engine
submitted and its workers have not yet confirmed, and the small records (chunk references,
sightings) the scheduler writes itself.

Only dumps every tensor-parallel rank confirmed count as stored: a block submitted moments ago is
a miss (`awaited` says so, so the request can wait for it) until every worker reported it.

Blocks are named by their content and never rewritten, so a chunk block known stored (found by
a lookup, or its dump confirmed) is answered from memory for `KNOWN_SECONDS` without asking the
mount again; a load that fails (another instance evicted it meanwhile) is computed instead and
forgets every such answer. Exact prompt blocks, and whether a block is stored before dumping it,
are always asked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ucm.integration.vllm.connector.metadata import UCMWorkerReport
from ucm.integration.vllm.connector.stats import UCMConnectorStats
from ucm.sparse.blend.chunk_refs import REF_BYTES, ChunkRef, decode_ref
from ucm.store.keys import KeyKind, StoreKey, shard_key, store_key

if TYPE_CHECKING:
    from ucm.store.base import KVStoreBase, Task

# A submitted dump no worker answered for this long is forgotten (the workers give up after dump_timeout_s).
PENDING_DUMP_SECONDS = 300.0
# A block found stored is taken as stored this long without a new lookup, at most KNOWN_BLOCKS of them.
KNOWN_SECONDS = 30.0
KNOWN_BLOCKS = 200_000
SIGHTINGS = "sightings"  # counter prefix of sighting records (sightings_stored, sightings_failed)
CHUNK_REFS = "chunk_refs"


@dataclass(frozen=True)
class KeySpace:
    """Where a request's block hashes are named in the store: the engine's namespace (model, dtype,
    KV geometry), to which a request served with a LoRA adapter adds the adapter's content digest
    (adapter_identity.py). Every store key of a request (KV, references, sightings) comes from here."""

    namespace: bytes

    def key(self, kind: KeyKind, block_hash: bytes) -> StoreKey:
        return store_key(self.namespace, kind, block_hash)

    def with_adapter(self, digest: str) -> KeySpace:
        return KeySpace(self.namespace + b"|lora:" + digest.encode())


@dataclass(frozen=True)
class WaitingRef:
    """A chunk reference written once every exact block it names is confirmed stored: a request
    whose dumps are refused or fail (an untrusted step) leaves no reference behind."""

    req_id: str
    key: bytes
    record: bytes
    sources: frozenset[bytes]  # store keys of the exact blocks
    since: float


class StoreView:
    def __init__(self, store: KVStoreBase, namespace: bytes, block_size: int, num_shards: int,
                 stats: UCMConnectorStats):
        self.store = store
        self.space = KeySpace(namespace)  # requests without an adapter
        self.block_size = block_size
        self.num_shards = num_shards  # tensor-parallel ranks: a block is stored only when every rank's shard is
        self.stats = stats
        self.pending: dict[bytes, float] = {}  # dumps submitted, not yet confirmed by every rank -> when
        self._confirmed: dict[bytes, int] = {}  # ranks that confirmed a pending dump so far
        self.awaited = False  # a lookup since the last `begin` missed a block this engine is writing
        self.refs_waiting: list[WaitingRef] = []  # chunk references whose exact blocks are not yet confirmed
        # Records (chunk references, sightings) written by the store's threads, not yet reaped:
        # (task, records, counter prefix).
        self.record_writes: list[tuple[Task, list[bytes], str]] = []
        self._known: dict[bytes, float] = {}  # block key -> when last found or confirmed stored, oldest first
        self._lookup_timeouts = 0  # the store's count when last read
        self._down_refusals = 0  # the same

    def begin(self) -> None:
        """A request's lookups start: `awaited` says afterwards whether any of them waits for this engine's writes."""
        self.awaited = False

    def lookup(self, space: KeySpace, kind: KeyKind, hashes, known: bool = True) -> list[bool]:
        """Which blocks the store holds, every tensor-parallel rank's shard of them (CHUNK_REF:
        whether a reference record is there, unchecked: `lookup_refs` reads and checks it).
        `known` False: the store is asked for every block (what decides a dump, or an exact
        prefix, which vLLM would not recompute if its load failed as a chunk block's is)."""
        return self.lookup_many(space, [(kind, hashes)], known)[0]

    def lookup_many(self, space: KeySpace, asks, known: bool = True) -> list[list[bool]]:
        """`lookup` of several (kind, hashes) at once: the store is asked for all of them in one
        call, one round trip on a remote mount where asking kind by kind costs one each."""
        keys = [[space.key(kind, h) for h in hashes] for kind, hashes in asks]
        now = time.monotonic()
        if self._known and self.store.down_for_s() > 0:  # held down: nothing counts as stored
            self.forget_known()
        found = [[known and now - self._known.get(k, -KNOWN_SECONDS) < KNOWN_SECONDS for k in ks] for ks in keys]
        # (ask, index) of each key the store is asked for, and its files: one per tensor-parallel
        # rank's shard, but one for a reference (a record, not KV).
        asked = [(a, i) for a, f in enumerate(found) for i, hit in enumerate(f) if not hit]
        if asked:
            files = [[keys[a][i]] if asks[a][0] is KeyKind.CHUNK_REF
                     else [shard_key(keys[a][i], r, self.num_shards) for r in range(self.num_shards)]
                     for a, i in asked]
            start = time.perf_counter()
            held = iter(self.store.lookup([f for fs in files for f in fs]))
            self.stats.add("lookup_seconds", time.perf_counter() - start)
            self.stats.add("lookup_rounds")
            for (a, i), fs in zip(asked, files):
                hit = all([next(held) for _ in fs])  # a list: every shard's answer is consumed
                found[a][i] = hit
                if hit:
                    self._remember(keys[a][i], now)
            self._count_store_refusals()
        self.stats.add("lookup_known_blocks", sum(len(ks) for ks in keys) - len(asked))
        for (kind, _), ks, f in zip(asks, keys, found):
            if kind is KeyKind.CHUNK_REF:
                self._await_records(ks, f)
            elif self.pending and any(not hit and k in self.pending for hit, k in zip(f, ks)):
                self.awaited = True
        return found

    def _await_records(self, keys: list[bytes], found: list[bool]) -> None:
        """`awaited` when a reference missing is one this engine is about to write: worth a short wait."""
        if self.refs_waiting or self.record_writes:
            coming = {r.key for r in self.refs_waiting} | {k for task, _, _ in self.record_writes for k in task.keys}
            self.awaited |= any(not hit and k in coming for hit, k in zip(found, keys))

    def _remember(self, key: bytes, now: float) -> None:
        self._known.pop(key, None)
        self._known[key] = now
        if len(self._known) > KNOWN_BLOCKS:
            del self._known[next(iter(self._known))]

    def forget_known(self) -> None:
        """A load failed or the store counts as down: every block is asked for again."""
        self._known.clear()

    def _count_store_refusals(self) -> None:
        stats = self.store.stats()
        if stats.lookup_timeouts != self._lookup_timeouts:  # the store did not answer in time: misses, computed
            self.stats.add("lookup_timeout_blocks", stats.lookup_timeouts - self._lookup_timeouts)
            self._lookup_timeouts = stats.lookup_timeouts
        if stats.down_refusals != self._down_refusals:  # the store counts as down: misses without IO
            self.stats.add("store_down_blocks", stats.down_refusals - self._down_refusals)
            self._down_refusals = stats.down_refusals

    def lookup_refs(self, space: KeySpace, blocks) -> list[ChunkRef | None]:
        """The references stored for these (chunk block hash, tokens), each only when every exact
        block it names is stored (every shard): a reference is only as good as its exact blocks."""
        keys = [space.key(KeyKind.CHUNK_REF, h) for h, _ in blocks]
        start = time.perf_counter()
        hits = self.store.lookup(keys)
        self.stats.add("lookup_rounds")
        found = [i for i, hit in enumerate(hits) if hit]
        self._await_records(keys, hits)
        records = [bytearray(REF_BYTES) for _ in found]
        # Small reads on the scheduler's path: a lookup's deadline, not a KV load's (a mount that
        # answers stats but not reads must not hold every step for load_timeout_s).
        ok = (self.store.wait(self.store.load([keys[i] for i in found], records), self.store.metadata_timeout_s)
              if found else [])
        self.stats.add("lookup_rounds", bool(found))
        self.stats.add("lookup_seconds", time.perf_counter() - start)
        refs: dict[int, ChunkRef] = {}
        for i, record, good in zip(found, records, ok):
            ref = decode_ref(record, blocks[i][1], self.block_size) if good else None
            if ref is not None:
                refs[i] = ref
        sources = sorted({h for ref in refs.values() for h in ref.sources})
        stored = dict(zip(sources, self.lookup(space, KeyKind.EXACT, sources)))
        return [refs[i] if i in refs and all(stored[h] for h in refs[i].sources) else None
                for i in range(len(blocks))]

    def seen(self, space: KeySpace, fingerprints) -> list[bool]:
        """Which segments have a sighting in the store, or one this engine is writing. A sighting
        the store does not answer for in time counts as none (the KV is then not stored)."""
        keys = [space.key(KeyKind.SIGHTING, f) for f in fingerprints]
        start = time.perf_counter()
        found = self.store.lookup(keys)
        self.stats.add("lookup_seconds", time.perf_counter() - start)
        self.stats.add("lookup_rounds")
        writing = {k for task, _, counter in self.record_writes if counter == SIGHTINGS for k in task.keys}
        return [hit or k in writing for hit, k in zip(found, keys)]

    def stored(self, space: KeySpace, block_hash: bytes) -> bool:
        """Whether the store holds this block as exact KV (every tensor-parallel rank's shard of
        it), or this engine's dump of it is on its way."""
        return (space.key(KeyKind.EXACT, block_hash) in self.pending
                or self.lookup(space, KeyKind.EXACT, [block_hash], known=False)[0])

    def submitted(self, keys) -> None:
        """Dumps handed to the workers this step: misses to lookups until confirmed."""
        now = time.monotonic()
        for key in keys:
            self.pending[key] = now

    def confirm(self, report: UCMWorkerReport, untrusted: set[str]) -> None:
        """The workers' answers about dumps; references of untrusted requests, or naming a block
        not stored, are dropped; dumps no worker answered for long are forgotten."""
        now = time.monotonic()
        for key, ranks in report.stored.items():
            confirmed = self._confirmed.pop(key, 0) + ranks
            if confirmed >= self.num_shards:
                self.pending.pop(key, None)
                self._remember(key, now)
            elif key in self.pending:
                self._confirmed[key] = confirmed
        for key in report.not_stored:
            self.pending.pop(key, None)
            self._confirmed.pop(key, None)
        if self.refs_waiting and (report.not_stored or untrusted):
            self.refs_waiting = [r for r in self.refs_waiting
                                 if r.req_id not in untrusted and not r.sources & report.not_stored]
        if self.pending:
            for key in [k for k, t in self.pending.items() if now - t > PENDING_DUMP_SECONDS]:
                del self.pending[key]
                self._confirmed.pop(key, None)

    def write_refs(self) -> None:
        """Hand the chunk references whose exact blocks are all confirmed to the store (written by
        its IO threads); a reference waiting longer than a dump is waited for is dropped."""
        if not self.refs_waiting:
            return
        now = time.monotonic()
        ready, waiting = [], []
        for ref in self.refs_waiting:
            if not any(k in self.pending for k in ref.sources):
                ready.append(ref)
            elif now - ref.since < PENDING_DUMP_SECONDS:
                waiting.append(ref)
        self.refs_waiting = waiting
        if ready:
            self.write_records([r.key for r in ready], [r.record for r in ready], CHUNK_REFS)

    def write_records(self, keys: list[bytes], records: list[bytes], counter: str) -> None:
        """Small records the scheduler writes (not KV): handed to the store's IO threads."""
        self.record_writes.append((self.store.dump(keys, records, [0] * len(keys)), records, counter))

    def reap_record_writes(self) -> None:
        still = []
        for task, records, counter in self.record_writes:
            if self.store.check(task):
                ok = self.store.wait(task)
                self.stats.add(f"{counter}_stored", sum(ok))
                self.stats.add(f"{counter}_failed", len(ok) - sum(ok))
            else:
                still.append((task, records, counter))
        self.record_writes = still
