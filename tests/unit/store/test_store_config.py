"""Configuration parsing: clear errors that name the offending key or directory."""

from __future__ import annotations

import logging

import pytest

from ucm.store import DramStore, NfsStoreConfig, UcmNfsStore, create_store


def test_from_dict_accepts_user_spellings():
    cfg = NfsStoreConfig.from_dict({"storage_backends": "/a:/b", "capacity_gb": 0, "io_threads": 8})
    assert cfg.storage_backends == ("/a", "/b")
    assert cfg.capacity_gb is None and cfg.capacity_bytes is None
    assert (cfg.io_direct, cfg.io_threads, cfg.dram_capacity_gb) == (False, 8, 0.0)
    cfg = NfsStoreConfig.from_dict({"storage_backends": ["/x"], "capacity_gb": 1.5, "dram_capacity_gb": 2})
    assert cfg.storage_backends == ("/x",) and cfg.capacity_bytes == int(1.5 * 2**30)
    assert cfg.dram_capacity_bytes == 2 * 2**30


@pytest.mark.parametrize(
    "key, value",
    [
        ("storage_backends", 5),
        ("storage_backends", ""),
        ("storage_backends", "/a::/b"),
        ("storage_backends", ["/a", "/a"]),
        ("capacity_gb", -1),
        ("capacity_gb", "10"),
        ("io_direct", "yes"),
        ("io_threads", 0),
        ("io_threads", "4"),
        ("io_threads", True),
        ("dram_capacity_gb", float("nan")),
        ("fsync", 1),
        ("temp_grace_s", -5),
        ("lookup_timeout_s", -1),
        ("lookup_timeout_s", "5"),
    ],
)
def test_bad_values_name_the_key(key, value):
    config = {"storage_backends": "/tmp/x", key: value}
    with pytest.raises(ValueError, match=key):
        NfsStoreConfig.from_dict(config)


def test_missing_backends_and_unknown_keys(caplog):
    with pytest.raises(ValueError, match="storage_backends"):
        NfsStoreConfig.from_dict({"capacity_gb": 1})
    with pytest.raises(ValueError, match="unknown key 'io_thread'; did you mean 'io_threads'"):
        NfsStoreConfig.from_dict({"storage_backends": "/tmp/x", "io_thread": 4})
    with caplog.at_level(logging.WARNING, logger="ucm.store.config"):
        NfsStoreConfig.from_dict({"storage_backends": "/tmp/x", "prefetch_depth": 4})
    assert "unknown key 'prefetch_depth' ignored" in caplog.text


def test_capacity_below_one_block_is_an_error_not_unlimited():
    with pytest.raises(ValueError, match="capacity_gb .* below one block file"):
        NfsStoreConfig.from_dict({"storage_backends": "/tmp/x", "capacity_gb": 1e-12})
    assert NfsStoreConfig.from_dict({"storage_backends": "/tmp/x", "capacity_gb": 0}).capacity_bytes is None


def test_uncreatable_backend_names_the_directory(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = str(blocker / "store")
    with pytest.raises(ValueError, match=bad):
        UcmNfsStore({"storage_backends": f"{tmp_path / 'ok'}:{bad}"})


def test_factory_builds_known_stores_and_lists_them_otherwise(tmp_path):
    store = create_store("UcmNfsStore", {"storage_backends": str(tmp_path)})
    try:
        assert isinstance(store, UcmNfsStore)
    finally:
        store.close()
    assert isinstance(create_store("UcmDramStore", {"capacity_gb": 0.01}), DramStore)
    with pytest.raises(ValueError, match="UcmNfsStore"):
        create_store("NfsStore", {})
    with pytest.raises(ValueError, match="capacity_gb"):
        create_store("UcmDramStore", {"capacity_gb": 0})


def test_relative_backend_is_resolved_and_said(caplog, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ucm.store.config"):
        config = NfsStoreConfig.from_dict({"storage_backends": "kv:/abs/kv"})
    assert config.storage_backends == (str(tmp_path / "kv"), "/abs/kv")
    assert "relative 'kv' resolved against the working directory" in caplog.text
