"""A fault in the worker's cache path hands the step's requests back to vLLM instead of raising:
their first externally computed block is reported as a load error (vLLM truncates and recomputes
from there), nothing of theirs is stored, and the scheduler hears `blend_error`. Faults are
injected through UCM_FAULTS and a real file; real store directory; no engine (the e2e test
test_blend_faults.py runs them in an engine)."""

from __future__ import annotations

import itertools
import logging
from types import SimpleNamespace

import pytest

from ucm.integration.vllm.connector.metadata import (BlendRegion, BlockDump, BlockLoad, RequestStep,
                                                     UCMConnectorMetadata)
from ucm.integration.vllm.connector.worker_side import WorkerSide
from ucm.integration.vllm.faults import FAULTS_ENV, ErrorLog, InjectedFault, inject
from ucm.store.factory import create_store
from ucm.store.keys import KeyKind, store_key

BS = 4


def worker(tmp_path) -> WorkerSide:
    store = create_store("UcmNfsStore", {"storage_backends": str(tmp_path / "store")})
    return WorkerSide(SimpleNamespace(cache_config=SimpleNamespace(block_size=BS)), store, check_layer=None)


def key(i: int) -> bytes:
    return store_key(b"ns", KeyKind.EXACT, bytes([i]) * 32)


@pytest.fixture
def faults(tmp_path, monkeypatch):
    path = tmp_path / "faults"
    path.write_text("")
    monkeypatch.setenv(FAULTS_ENV, str(path))
    return path


def test_inject_raises_only_for_the_stages_the_file_names(faults, monkeypatch):
    inject("load")  # empty file: no fault
    faults.write_text("rotate, dump")
    inject("load")
    with pytest.raises(InjectedFault, match="'dump'"):
        inject("dump")
    faults.unlink()
    inject("dump")  # no file: no fault
    monkeypatch.delenv(FAULTS_ENV)
    inject("dump")


def test_a_share_of_a_stages_calls_raises(faults, monkeypatch):
    """`stage~P`: about P of the stage's calls raise, drawn at random; other stages never."""
    faults.write_text("load~0.25 dump~x")
    monkeypatch.setattr("random.random", itertools.cycle([0.1, 0.3, 0.2, 0.9]).__next__)
    raised = 0
    for _ in range(100):
        try:
            inject("load")
        except InjectedFault:
            raised += 1
    assert raised == 50
    inject("dump")  # a share that is no number names no fault
    inject("rotate")


def test_error_log_gives_the_traceback_once_per_stage(caplog):
    log = ErrorLog(logging.getLogger("ucm.test"))
    with caplog.at_level(logging.WARNING, logger="ucm.test"):
        for _ in range(3):
            log.error("load", ValueError("bad"), "computed by vLLM")
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and len(caplog.records) == 3
    assert all("load" in r.getMessage() for r in caplog.records)


def test_a_load_that_raises_reports_load_errors_instead(tmp_path, faults):
    w = worker(tmp_path)
    prefix = RequestStep("p", [10, 11, 12], 0, 1, prefix_loads=[BlockLoad(key(1), BS, BS)])
    blend = RequestStep("b", [20, 21, 22], BS, 1, blend=BlendRegion(BS, [5, 6, 7, 8], 0.15),
                        dumps=[BlockDump(key(2), 0, BS)])
    meta = UCMConnectorMetadata([prefix, blend])
    faults.write_text("load")
    w.start_load_kv(meta)  # does not raise
    assert w.take_blend_step() is None
    # vLLM truncates each at its first external block and computes the rest itself.
    assert w.get_block_ids_with_load_errors() == {11, 21}
    faults.write_text("")
    w.wait_for_save(meta)  # the failed requests store nothing
    report = w.build_report()
    assert report.blend_error == {"p", "b"}
    assert report.not_stored == {key(2)}
    assert w.stats.data["blend_errors"] == 1 and w.stats.data["dumps_refused"] == 1


def test_a_blend_forward_that_raised_hands_its_requests_to_vllm(tmp_path):
    w = worker(tmp_path)
    blend = RequestStep("b", [20, 21, 22, 23], 0, 1, prefix_loads=[BlockLoad(key(1), 0, BS)],
                        blend=BlendRegion(2 * BS, [5] * BS, 0.15))
    w._blend_requests = [blend]  # as start_load_kv leaves them for the forward
    w.blend_forward_failed(RuntimeError("boom"))
    # The prefix was loaded before the forward: only the region is recomputed.
    assert w.get_block_ids_with_load_errors() == {22}
    assert w.build_report().blend_error == {"b"}


def test_a_dump_that_raises_stores_nothing_of_the_step(tmp_path, faults):
    w = worker(tmp_path)
    meta = UCMConnectorMetadata([RequestStep("a", [1], 0, BS, dumps=[BlockDump(key(4), 0, BS)])])
    faults.write_text("dump")
    w.wait_for_save(meta)  # does not raise
    report = w.build_report()
    assert report.not_stored == {key(4)} and not w._pending
    assert w.stats.data["dump_errors"] == 1

