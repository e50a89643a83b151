"""A Blend step's chunk KV read layer group by layer group while its forward runs (`use_layerwise`).

Stored blocks are layer-major, one store segment per layer (block_tensors.py), so a group of layers
of every chunk block is one store task. The first group, the layers up to the check layer, is read
before the forward as the whole blocks were: a block that does not load is left to the forward to
compute, as before, and the check layer's loaded KV is there for the selection. The later groups
are read while the forward runs the layers before them; before a layer's attention runs, the
forward asks for it (`BlendStep.wait_layers`), which waits for its group's read and rotates and
writes that group's layers into the paged cache. A block that fails in a later group fails the
step's Blend forward (its requests are then computed by vLLM and nothing of them is stored): by
then the selection has counted on that block's KV.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ucm.integration.vllm.connector.block_tensors import layer_parts
from ucm.integration.vllm.connector.chunk_prefetch import read_others
from ucm.store.base import KVStoreBase, Task

# Layers per group after the first: fewer, larger reads cost fewer opens and header reads per block
# (a round trip each on a network file system); more, smaller ones start the forward's overlap sooner.
LAYERS_PER_GROUP = 4


class LayerLoadFailed(RuntimeError):
    """A block's later layers did not load: the step's Blend forward falls back to vLLM."""


def layer_groups(num_layers: int, check_layer: int, per_group: int = LAYERS_PER_GROUP) -> list[tuple[int, int]]:
    """The [start, end) layer ranges read one after the other: through the check layer, then
    `per_group` layers at a time."""
    first = min(num_layers, check_layer + 1)
    return [(0, first)] + [(a, min(a + per_group, num_layers)) for a in range(first, num_layers, per_group)]


def read_step(store: KVStoreBase, keys: list[bytes], destinations: list[torch.Tensor], filled: set[int],
              layered: int, num_layers: int, check_layer: int | None, stats,
              shared: dict[int, int] | None = None) -> tuple[Task, list[bool], int, LayerwiseLoad | None]:
    """Reads a step's blocks not `filled` from prefetches: (task, each block's outcome, bytes read,
    the layer-wise reads still running). Of the first `layered` blocks (chunk blocks of Blend
    requests, read layer-wise) only the first layer group is waited for. A `shared` block (index ->
    the block whose read lands in its destination too) is not read: its outcome is that block's."""
    shared = shared or {}
    stats.add("shared_reads", len(shared))
    skipped = filled | set(shared)
    later = [i for i in range(layered) if i not in skipped]
    stats.add("layerwise_blocks", len(later))
    layerwise = LayerwiseLoad(store, [keys[i] for i in later], [destinations[i] for i in later],
                              layer_groups(num_layers, check_layer), stats) if later else None
    task, ok, read_bytes = read_others(store, keys, destinations, skipped | set(later),
                                       after_submit=layerwise.start_later if layerwise else lambda: None)
    for i, good in zip(later, layerwise.first_group() if layerwise else ()):
        ok[i] = good
    for i, j in shared.items():
        ok[i] = ok[j]
    return task, ok, read_bytes, layerwise


class LayerwiseLoad:
    """The later layer groups of a step's chunk blocks, read while the forward runs.

    `place(start, end)` rotates and writes layers [start, end) of the loaded rows into the cache
    once their reads are in; `stats` gets the time the forward waited for them.
    """

    def __init__(self, store: KVStoreBase, keys: Sequence[bytes], destinations: Sequence[torch.Tensor],
                 groups: list[tuple[int, int]], stats):
        self.store = store
        self.groups = groups
        self.place: Callable[[int, int], object] = lambda start, end: None  # set once the rows are known
        self.stats = stats
        self._keys, self._destinations = list(keys), list(destinations)
        self._tasks: list[Task] = []
        self._submit(0)  # the first group: read and placed before the forward
        self._next = 1
        self._ended: list[bool] = [False] * len(groups)
        self._placed: list[bool] = [True] * len(self._keys)  # blocks the forward counts on

    def first_group(self) -> list[bool]:
        """Waits for the first group's reads: each block's outcome. A block that failed there is
        not loaded (the forward computes its tokens): its later reads do not matter."""
        self._placed = self._wait(0)
        return self._placed

    def start_later(self) -> None:
        """Submits the later groups' reads (after the step's other reads, which the forward needs first)."""
        for g in range(1, len(self.groups)):
            self._submit(g)

    def _submit(self, g: int) -> None:
        a, b = self.groups[g]
        self._tasks.append(self.store.load_segments(self._keys, [layer_parts(d, a, b) for d in self._destinations],
                                                    a, self.groups[-1][1]))

    def ready(self, layer: int) -> None:
        """Places every group up to the one holding `layer` (waiting for their reads); raises
        LayerLoadFailed when a block of one of them failed."""
        while self._next < len(self.groups) and self.groups[self._next][0] <= layer:
            start = time.perf_counter()
            ok = self._wait(self._next)
            self.stats.add("layerwise_wait_seconds", time.perf_counter() - start)
            failed = sum(placed and not good for placed, good in zip(self._placed, ok))
            if failed:
                raise LayerLoadFailed(f"{failed} chunk block(s) did not load layers "
                                      f"{self.groups[self._next][0]}..{self.groups[self._next][1] - 1}")
            self.place(*self.groups[self._next])
            self._next += 1

    def finish(self) -> bool:
        """Ends the reads still running (a forward that stopped early leaves some): waited for,
        but once one passed its deadline the others are given up at once, so a hung mount costs
        one deadline, not one per group. Whether the destinations are free again (False: a read
        given up may still write them)."""
        hung = any(self._tasks[g].timed_out for g in range(len(self._tasks)) if self._ended[g])
        for g in range(len(self._tasks)):
            if not self._ended[g]:
                self._wait(g, 1e-3 if hung else None)
                hung = hung or self._tasks[g].timed_out
        return not hung

    def _wait(self, g: int, timeout_s: float | None = None) -> list[bool]:
        ok = self.store.wait(self._tasks[g], timeout_s)
        self._ended[g] = True
        return ok
