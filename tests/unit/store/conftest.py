from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Test modules and `spawn`ed worker processes import the shared helpers by plain module name;
# pytest runs with --import-mode=importlib, which does not put this directory on sys.path.
# (Spawned children inherit the parent's sys.path.)
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from ucm.store import UcmNfsStore  # noqa: E402


@pytest.fixture
def make_store(tmp_path):
    """Opens UcmNfsStore instances (default backend: tmp_path/"store") and closes them after the test."""
    stores: list[UcmNfsStore] = []

    def make(**config) -> UcmNfsStore:
        config.setdefault("storage_backends", str(tmp_path / "store"))
        store = UcmNfsStore(config)
        store.wait_open_scan()
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()
