"""The worker half never hands the store KV it cannot vouch for: dumps of a request whose load
failed, and every dump of a step whose Blend region the forward did not run, are refused and
reported to the scheduler (nothing is gathered or written). Real store directory; no engine."""

from __future__ import annotations

from types import SimpleNamespace

from ucm.integration.vllm.connector.metadata import BlendRegion, BlockDump, RequestStep, UCMConnectorMetadata
from ucm.integration.vllm.connector.worker_side import WorkerSide
from ucm.store.factory import create_store
from ucm.store.keys import KeyKind, store_key


def worker(tmp_path) -> WorkerSide:
    store = create_store("UcmNfsStore", {"storage_backends": str(tmp_path / "store")})
    return WorkerSide(SimpleNamespace(cache_config=SimpleNamespace(block_size=4)), store, check_layer=None)


def step_with_dumps(*req_ids: str, blend: bool = False) -> UCMConnectorMetadata:
    meta = UCMConnectorMetadata()
    for i, req_id in enumerate(req_ids):
        key = store_key(b"ns", KeyKind.EXACT, bytes([i]) * 32)
        meta.requests.append(RequestStep(req_id, [1, 2], 0, 8, dumps=[BlockDump(key, 0, 4)],
                                         blend=BlendRegion(0, [5, 6, 7], 0.15) if blend else None))
    return meta


def test_a_request_whose_load_failed_dumps_nothing_until_it_finishes(tmp_path):
    w = worker(tmp_path)
    w._distrust("a")
    meta = step_with_dumps("a")
    w.wait_for_save(meta)
    report = w.build_report()
    assert report.load_failed == {"a"} and report.not_stored == {meta.requests[0].dumps[0].key}
    assert w.stats.data["dumps_refused"] == 1 and not w._pending
    w.forget({"a"})  # finished: its id is never seen again
    assert not w._untrusted


def test_a_step_whose_blend_region_was_not_run_stores_nothing(tmp_path):
    w = worker(tmp_path)
    w._blend_step = object()  # loaded for a Blend forward that never took it
    meta = step_with_dumps("a", "b", blend=True)
    w.wait_for_save(meta)
    report = w.build_report()
    assert report.not_blended == {"a", "b"}
    assert report.not_stored == {d.key for r in meta.requests for d in r.dumps}
    assert w.stats.data["dumps_refused"] == 2 and not w._pending
    assert w.build_report() is None  # reported once


def test_while_the_store_is_down_nothing_is_gathered_and_the_scheduler_is_told(tmp_path):
    """A store counted as down (here: told so, as the scheduler's store is by a worker) refuses
    dumps without IO: the worker does not gather their KV, reports them not stored and reports
    how long the store stays down, every step until it answers again."""
    w = worker(tmp_path)
    w.store.hold_down(30)
    meta = step_with_dumps("a")
    w.wait_for_save(meta)
    report = w.build_report()
    assert report.not_stored == {meta.requests[0].dumps[0].key} and 0 < report.store_down_s <= 30
    assert w.stats.data["store_down_blocks"] == 1 and not w._pending
    assert w.build_report().store_down_s > 0  # said again on the next step
