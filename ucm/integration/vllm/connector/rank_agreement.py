"""Load outcomes agreed by every tensor-parallel rank before any row is built or block stored.

Each rank reads its own shard of every block, so a shard missing, corrupt or late on one rank
fails that rank's load alone. The Blend forward's row-parallel layers and all-reduces need every
rank to run the same rows, and a block's KV is only right where every rank's shard of it is:
ranks acting on their own outcomes would run different rows (a hang or a crash in a collective)
and the healthy ranks would store shards computed over KV the failing rank never had. So after
the reads the ranks all-reduce one flag per block, and one per rank whose load raised: a block
counts as loaded only where every rank loaded it, and a fault on one rank is a fault on all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums over the tensor-parallel group


def _vllm_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(tensor)


def tensor_parallel_rank_and_size() -> tuple[int, int]:
    """(rank, world size) of this worker's tensor-parallel group; (0, 1) outside a vLLM worker."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


class PeerLoadFailed(RuntimeError):
    """Another tensor-parallel rank failed this step's loads: this rank hands the step back too."""


class RankAgreement:
    """The two agreements of a step with loads: the per-block outcome and whether any rank failed.
    Every rank makes the same calls in the same order (the scheduler sends all ranks the same
    step), so a rank whose load raised before the first agreement still joins it (`joined`)."""

    def __init__(self, world: int, all_reduce: AllReduce | None = None):
        self.world = world
        self._all_reduce = all_reduce or _vllm_all_reduce
        self.joined = False  # this step's per-block agreement made

    def begin_step(self) -> None:
        self.joined = False

    def loaded(self, num_blocks: int, ok: list[bool] | None) -> list[bool] | None:
        """Per block, whether every rank loaded its shard; None when some rank's load raised
        (`ok` None on this one)."""
        self.joined = True
        if self.world == 1:
            return ok
        bad = torch.ones(num_blocks + 1, dtype=torch.float32)
        if ok is not None:
            if len(ok) != num_blocks:
                raise ValueError(f"{len(ok)} load outcomes for {num_blocks} blocks")
            bad[0] = 0.0
            bad[1:] = torch.tensor([0.0 if good else 1.0 for good in ok], dtype=torch.float32)
        bad = self._all_reduce(bad)
        if bool(bad[0] > 0):
            return None
        return (bad[1:] == 0).tolist()

    def any_failed(self, failed: bool) -> bool:
        """Whether this rank or another failed the step's loads (each rank says once per step)."""
        if self.world == 1:
            return failed
        flag = self._all_reduce(torch.tensor([1.0 if failed else 0.0], dtype=torch.float32))
        return bool(flag[0] > 0)
