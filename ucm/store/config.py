"""Typed configuration of UcmNfsStore, parsed from the user's `ucm_connector_config` dict."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

logger = logging.getLogger(__name__)

GB = 1 << 30
# The part of a load's deadline that does not grow with its bytes (opens, a cold attribute cache).
LOAD_GRACE_S = 2.0
HEADER_BYTES_MIN = 4096  # a block file's header region: no smaller capacity can hold a block
# Keys of UCM's own store schema that mean nothing here: accepted, with a note.
UCM_NO_EFFECT_KEYS = frozenset({"kv_block_size", "use_layerwise", "load_only_first_rank", "role", "device",
                                "io_size", "local_rank_size"})


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (the keys are short).

    Kept instead of difflib.get_close_matches: no cutoff of its similarity ratio separates typos
    from keys that are merely alike. 'ucm_connector_cfg' (0.92 to ucm_connector_config) and
    'chunk_end_token' (0.91 to chunk_end_token_id) are other keys, 'ratios' (0.91 to ratio) is a
    typo. "One or two edits" is a rule users can predict.
    """
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def near_miss(key: str, known: set[str] | frozenset[str], max_edits: int = 2) -> str | None:
    """The known key `key` is a typo of (one or two edits away), if any."""
    close = sorted((edit_distance(key, k), k) for k in known)
    return close[0][1] if close and close[0][0] <= max_edits else None


def check_unknown_keys(d: Mapping[str, Any], known: set[str] | frozenset[str], where: str,
                       no_effect: frozenset[str] = frozenset()) -> None:
    """A key one or two edits from a known one is a typo: an error naming the key it resembles (a
    misspelt `capacity_gb` would otherwise leave the store unlimited). Keys that have no effect
    here get a note; any other unknown key a warning."""
    for key in sorted(str(k) for k in d if k not in known):
        near = near_miss(key, known)
        if near is not None:
            raise ValueError(f"{where}: unknown key {key!r}; did you mean {near!r}?")
        if key in no_effect:
            logger.info("%s: %r has no effect here (accepted for compatibility)", where, key)
        else:
            logger.warning("%s: unknown key %r ignored", where, key)


@dataclass(frozen=True)
class NfsStoreConfig:
    """Settings of the shared file store.

    All instances sharing a directory must list `storage_backends` in the same order: a key's
    backend is chosen by its hash modulo their number.

    `fsync` is off by default: a block is complete for other readers once renamed (close-to-open
    on NFS), and only a machine crash can lose it, which costs a recomputation, never wrong
    bytes (the checksum rejects a torn file).
    """

    storage_backends: tuple[str, ...]
    capacity_gb: float | None = None  # None: unlimited
    io_direct: bool = False
    # Reads and writes in flight at once: on NFS each open, read and close is a round trip to the
    # server, so a load's time is its round trips over this; on a local disk more threads cost nothing.
    io_threads: int = 16
    dram_capacity_gb: float = 0.0  # 0: no DRAM tier
    fsync: bool = False
    # Temp files of writers on other hosts (whose pids we cannot check) older than this are
    # removed when a store opens the directory.
    temp_grace_s: float = 600.0
    # How often a capacity-limited store rescans the directories to see other writers' usage.
    usage_rescan_s: float = 60.0
    # A read refreshes a block's mtime (the cross-process LRU clock) at most this often: at most
    # one metadata write per block per interval; longer, and blocks read by other processes
    # within it look as old as their write (evicted while hot).
    touch_interval_s: float = 1.0
    # A load not finished by then is a miss (the blocks are recomputed): a hung mount must not
    # stall the engine. Its buffers stay pinned until the IO returns. 0: wait for ever.
    load_timeout_s: float = 30.0
    # A load is also given up once it runs slower than this (after LOAD_GRACE_S): a step waits for
    # its loads, so a stalled mount should cost what its bytes would take on a slow link, not
    # load_timeout_s. 0: load_timeout_s alone.
    load_min_mb_s: float = 20.0
    # A dump not written by then counts as not stored for its caller, which stops waiting (the
    # worker waits for its dumps before each step's loads: a hung mount must not stall it). The IO
    # goes on in the background, buffers pinned, and is accounted when it returns. 0: wait for ever.
    dump_timeout_s: float = 60.0
    # A lookup (one stat per block) not answered by then is all misses, and so is every lookup
    # until it returns: the scheduler asks the store on every step and must not hang with the
    # mount. 0: wait for ever (in the calling thread).
    lookup_timeout_s: float = 5.0
    # After a load, dump or lookup passes its deadline the store counts as down (lookups miss,
    # loads and dumps are refused at once) for this long, doubled while it stays down, up to
    # down_backoff_max_s; then it is tried again once the IO that timed out has returned. 0: never
    # counted as down (every request waits out its own deadline).
    down_backoff_s: float = 5.0
    down_backoff_max_s: float = 60.0
    # Bytes of dumps a writer may have handed to the store and not yet seen written: beyond it
    # new dumps are dropped (counted), so cold traffic cannot queue KV faster than the disk takes it.
    dump_queue_mb: float = 1024.0

    @property
    def capacity_bytes(self) -> int | None:
        return None if self.capacity_gb is None else int(self.capacity_gb * GB)

    @property
    def dram_capacity_bytes(self) -> int:
        return int(self.dram_capacity_gb * GB)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NfsStoreConfig:
        if not isinstance(d, Mapping):
            raise ValueError(f"store config must be a dict, got {type(d).__name__}")
        check_unknown_keys(d, {f.name for f in fields(cls)}, "UcmNfsStore config", UCM_NO_EFFECT_KEYS)
        if "storage_backends" not in d:
            raise ValueError("storage_backends is required (a directory, or several separated by ':')")
        capacity = _number(d, "capacity_gb", None, minimum=0.0)
        if capacity and capacity * GB < HEADER_BYTES_MIN:
            raise ValueError(f"capacity_gb {capacity!r} is below one block file ({HEADER_BYTES_MIN} bytes); "
                             "use 0 or leave it out for no limit")
        backoff = _number(d, "down_backoff_s", 5.0, minimum=0.0)
        backoff_max = _number(d, "down_backoff_max_s", max(60.0, backoff), minimum=0.0)
        if backoff_max < backoff:
            raise ValueError(f"down_backoff_max_s ({backoff_max}) is below down_backoff_s ({backoff})")
        return cls(
            storage_backends=_backends(d["storage_backends"]),
            capacity_gb=capacity or None,
            io_direct=_bool(d, "io_direct", False),
            io_threads=_int(d, "io_threads", 16, minimum=1, maximum=256),
            dram_capacity_gb=_number(d, "dram_capacity_gb", 0.0, minimum=0.0) or 0.0,
            fsync=_bool(d, "fsync", False),
            temp_grace_s=_number(d, "temp_grace_s", 600.0, minimum=0.0),
            usage_rescan_s=_number(d, "usage_rescan_s", 60.0, minimum=0.0),
            touch_interval_s=_number(d, "touch_interval_s", 1.0, minimum=0.0),
            load_timeout_s=_number(d, "load_timeout_s", 30.0, minimum=0.0),
            load_min_mb_s=_number(d, "load_min_mb_s", 20.0, minimum=0.0),
            dump_timeout_s=_number(d, "dump_timeout_s", 60.0, minimum=0.0),
            lookup_timeout_s=_number(d, "lookup_timeout_s", 5.0, minimum=0.0),
            dump_queue_mb=_number(d, "dump_queue_mb", 1024.0, minimum=0.0),
            down_backoff_s=backoff,
            down_backoff_max_s=backoff_max,
        )


def _backends(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        parts = value.split(":")
    elif isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        parts = list(value)
    else:
        raise ValueError(f"storage_backends must be a str or a list of str, got {value!r}")
    parts = [p.strip() for p in parts]
    if not parts or any(not p for p in parts):
        raise ValueError(f"storage_backends has an empty directory: {value!r}")
    relative = [d for d in parts if not os.path.isabs(d)]
    if relative:  # every instance must name the same directories: say where a relative one landed
        parts = [os.path.abspath(d) for d in parts]
        logger.warning("storage_backends: relative %s resolved against the working directory %s: %s",
                       ", ".join(map(repr, relative)), os.getcwd(), ":".join(parts))
    if len(set(parts)) != len(parts):
        raise ValueError(f"storage_backends lists a directory twice: {value!r}")
    return tuple(parts)


def _bool(d: Mapping[str, Any], key: str, default: bool) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _int(d: Mapping[str, Any], key: str, default: int, minimum: int, maximum: int) -> int:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{key} must be an integer in {minimum}..{maximum}, got {value!r}")
    return value


def _number(d: Mapping[str, Any], key: str, default: float | None, minimum: float) -> float | None:
    value = d.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{key} must be a number >= {minimum}, got {value!r}")
    return float(value)
