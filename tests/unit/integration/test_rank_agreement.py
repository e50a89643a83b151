"""Tensor-parallel ranks agree on their load outcomes: two real processes, a real collective
(torch.distributed over gloo), one rank's shard failing or one rank's load raising."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from ucm.integration.vllm.connector.rank_agreement import RankAgreement


def _rank(rank: int, init_file: str, outcomes, queue) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    agreement = RankAgreement(2, all_reduce)
    results = []
    for ok, raised in outcomes[rank]:
        agreement.begin_step()
        loaded = agreement.loaded(3, None if raised else ok)
        results.append((loaded, agreement.any_failed(loaded is None)))
    queue.put((rank, results))
    dist.destroy_process_group()


def test_ranks_agree_on_every_blocks_outcome_and_on_a_fault(tmp_path):
    steps = {  # per rank: (its own per-block outcome, whether its load raised)
        0: [([True, True, True], False), ([True, True, True], False), ([True, True, True], False)],
        1: [([True, True, True], False), ([True, False, True], False), ([True, True, True], True)],
    }
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "init"), steps, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    expected = [([True, True, True], False),  # both loaded everything
                ([True, False, True], False),  # rank 1's shard of block 1 failed: failed on both
                (None, True)]  # rank 1 raised: both hand the step back
    assert results[0] == expected and results[1] == expected


def test_one_rank_is_its_own_agreement():
    agreement = RankAgreement(1, all_reduce=None)
    assert agreement.loaded(2, [True, False]) == [True, False] and agreement.joined
    assert agreement.any_failed(True) and not agreement.any_failed(False)


def test_outcomes_must_cover_every_block():
    agreement = RankAgreement(2, all_reduce=lambda t: t)
    with pytest.raises(ValueError, match="2 load outcomes for 3 blocks"):
        agreement.loaded(3, [True, False])
