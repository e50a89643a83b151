"""Shared KV block store: blocks keyed by digest, shared by many vLLM instances via a directory."""

from ucm.store.base import BlockMeta, KVStoreBase, StoreStats, Task
from ucm.store.config import NfsStoreConfig
from ucm.store.dram_store import DramStore
from ucm.store.factory import create_store
from ucm.store.nfs_store import UcmNfsStore

__all__ = [
    "BlockMeta",
    "DramStore",
    "KVStoreBase",
    "NfsStoreConfig",
    "StoreStats",
    "Task",
    "UcmNfsStore",
    "create_store",
]
