"""The connector's counters as vLLM's stats plumbing handles them: summed across workers and
the scheduler, shipped between processes (pickle), logged and exported to Prometheus."""

from __future__ import annotations

import functools
import pickle
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ucm.integration.vllm.connector.stats import COUNTERS, UCMConnectorStats, UCMPromMetrics, ucm_counters
from ucm.integration.vllm.connector.ucm_connector import UCMConnector


def test_add_take_and_aggregate_like_vllm():
    worker0, worker1, scheduler = UCMConnectorStats(), UCMConnectorStats(), UCMConnectorStats()
    worker0.add("loaded_blocks", 3)
    worker0.add("load_bytes", 3_000_000)
    worker0.add("load_seconds", 0.5)
    worker1.add("loaded_blocks", 3)
    worker1.add("load_bytes", 3_000_000)
    worker1.add("load_seconds", 0.25)
    scheduler.add("requests")
    scheduler.add("chunk_hit_tokens", 48)
    scheduler.add("failed_blocks", 0)  # zero adds nothing

    taken = [s.take() for s in (worker0, worker1, scheduler)]
    assert all(s.is_empty() for s in (worker0, worker1, scheduler))
    assert worker0.take() is None  # nothing new happened

    # vLLM: the first worker's object accumulates the others, then the scheduler's.
    total = pickle.loads(pickle.dumps(taken[0])).aggregate(taken[1]).aggregate(taken[2])
    assert total.data == {"loaded_blocks": 6, "load_bytes": 6_000_000, "load_seconds": 0.75, "requests": 1,
                          "chunk_hit_tokens": 48}
    rebuilt = UCMConnector.build_kv_connector_stats(total.to_dict())
    assert isinstance(rebuilt, UCMConnectorStats) and rebuilt.data == total.data
    assert rebuilt.reduce()["load_GB_per_s"] == pytest.approx(0.01)
    # The worker's own counts were not changed by aggregation on the receiving side.
    assert taken[1].data["loaded_blocks"] == 3


def test_unknown_counter_is_an_error():
    with pytest.raises(KeyError, match="unknown UCM counter 'bogus'"):
        UCMConnectorStats().add("bogus")


def test_prometheus_counters_per_engine():
    registry = CollectorRegistry()
    types = {Counter: functools.partial(Counter, registry=registry), Gauge: Gauge, Histogram: Histogram}
    prom = UCMConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    assert isinstance(prom, UCMPromMetrics)
    prom.observe({"recomputed_tokens": 30, "reused_tokens": 170}, engine_idx=0)
    prom.observe({"recomputed_tokens": 5}, engine_idx=1)
    prom.observe({"recomputed_tokens": 1}, engine_idx=0)

    def value(name, engine):
        return registry.get_sample_value(f"vllm:ucm_{name}_total", {"model_name": "m", "engine": engine})

    assert value("recomputed_tokens", "0") == 31
    assert value("recomputed_tokens", "1") == 5
    assert value("reused_tokens", "0") == 170
    exported = {m.name for m in registry.collect()}
    assert exported == {f"vllm:ucm_{name}" for name in COUNTERS}


def test_ucm_counters_reads_llm_get_metrics():
    from vllm.v1.metrics.reader import Counter as SnapshotCounter, Gauge as SnapshotGauge

    metrics = [SnapshotCounter("vllm:ucm_loaded_blocks", {"engine": "0"}, 4),
               SnapshotCounter("vllm:ucm_loaded_blocks", {"engine": "1"}, 2),
               SnapshotCounter("vllm:prompt_tokens", {"engine": "0"}, 100),
               SnapshotGauge("vllm:num_requests_running", {}, 1.0)]
    assert ucm_counters(metrics) == {"loaded_blocks": 6}
