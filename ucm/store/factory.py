"""Builds a store from the name and dict a user puts in `ucm_connector_config`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ucm.store.base import KVStoreBase
from ucm.store.config import GB


def _nfs(config: Mapping[str, Any]) -> KVStoreBase:
    from ucm.store.nfs_store import UcmNfsStore

    return UcmNfsStore(config)


def _dram(config: Mapping[str, Any]) -> KVStoreBase:
    from ucm.store.dram_store import DramStore

    unknown = sorted(set(config) - {"capacity_gb"})
    if unknown:
        raise ValueError(f"UcmDramStore: unknown config keys {', '.join(unknown)} (only capacity_gb)")
    capacity = config.get("capacity_gb")
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or capacity <= 0:
        raise ValueError(f"capacity_gb must be a number > 0 for UcmDramStore, got {capacity!r}")
    return DramStore(int(capacity * GB))


STORES: dict[str, Callable[[Mapping[str, Any]], KVStoreBase]] = {
    "UcmNfsStore": _nfs,
    "UcmDramStore": _dram,
}


def create_store(name: str, config: Mapping[str, Any]) -> KVStoreBase:
    try:
        build = STORES[name]
    except KeyError:
        raise ValueError(f"unknown store {name!r}; known stores: {', '.join(sorted(STORES))}") from None
    return build(config)
