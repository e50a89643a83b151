"""A fault on one tensor-parallel rank in the Blend forward becomes a fault on both: two real
processes, a real collective (torch.distributed over gloo) between the guarded work and the
settle point, as a layer's all-reduce sits between the forward's rank-local parts."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from ucm.integration.vllm.blend.rank_faults import RankFault, RankFaults


def _rank(rank: int, init_file: str, faults_file: str, steps: list[str], queue) -> None:
    import os

    import torch
    import torch.distributed as dist

    from ucm.integration.vllm.faults import FAULTS_ENV, inject

    os.environ[FAULTS_ENV] = faults_file
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    results = []
    for faults_named in steps:
        if rank == 0:
            with open(faults_file, "w") as f:
                f.write(faults_named)
        dist.barrier()  # both ranks see this step's file
        faults = RankFaults(2, all_reduce)
        with faults.guarded("selection"):
            inject("select")  # "select@1": rank 1 only
        layer_sum = float(all_reduce(torch.ones(1))[0])  # a layer's collective after the guarded part
        try:
            faults.settle()
            results.append(("ok", layer_sum))
        except RankFault as exc:
            results.append(("this rank" if exc.__cause__ is not None else "another rank", layer_sum))
    queue.put((rank, results))
    dist.destroy_process_group()


def test_one_ranks_exception_reaches_both_ranks_at_the_settle_point(tmp_path):
    steps = ["", "select@1", "select", ""]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "init"), str(tmp_path / "faults"), steps, queue))
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=120) for _ in procs)  # a rank left in a collective: no result
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert results[0] == [("ok", 2.0), ("another rank", 2.0), ("this rank", 2.0), ("ok", 2.0)]
    assert results[1] == [("ok", 2.0), ("this rank", 2.0), ("this rank", 2.0), ("ok", 2.0)]


def test_one_rank_raises_at_once():
    faults = RankFaults(1, all_reduce=None)
    with pytest.raises(ValueError):
        with faults.guarded("selection"):
            raise ValueError("bad")
    faults.settle()  # nothing to agree on


def test_the_first_fault_is_the_one_reported():
    faults = RankFaults(2, all_reduce=lambda t: t)
    with faults.guarded("probe"):
        raise KeyError("first")
    with faults.guarded("selection"):
        raise ValueError("second")
    with pytest.raises(RankFault, match="probe failed on this rank: KeyError") as info:
        faults.settle()
    assert isinstance(info.value.__cause__, KeyError)
