"""A fault on one tensor-parallel rank made a fault on every rank, at points they all reach.

The Blend forward's layers hold collectives (vLLM's row-parallel all-reduces, the all-reduces of
the selection scores): a rank that raised between two of them would leave the others waiting in
the next one for ever. So under tensor parallelism the forward's own rank-local work (the subset
attention, the deviation and attention scores, the selection, the KV shift plan) runs in
`guarded` sections: an exception there is recorded and the rank goes on with what it has, whose
shapes are those every rank agreed on (the step's output is discarded anyway); at each `settle`
every rank learns whether any rank faulted and all raise together, so all fall back to vLLM's
forward for the step (models.py). With one rank there is nothing to keep in step: exceptions
propagate at once, as everywhere else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums over the tensor-parallel group


class RankFault(RuntimeError):
    """The Blend forward failed on this or another tensor-parallel rank (raised on every rank)."""


def _vllm_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(tensor)


class RankFaults:
    def __init__(self, world: int, all_reduce: AllReduce | None = None):
        self.world = world
        self._all_reduce = all_reduce or _vllm_all_reduce
        self.error: tuple[str, BaseException] | None = None  # this rank's first fault

    @classmethod
    def of_tensor_parallel_group(cls) -> RankFaults:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return cls(get_tensor_model_parallel_world_size())

    @contextlib.contextmanager
    def guarded(self, stage: str):
        """Runs rank-local work; with several ranks an exception is kept for `settle`, not raised."""
        if self.world == 1:
            yield
            return
        try:
            yield
        except Exception as exc:
            if self.error is None:
                self.error = (stage, exc)

    def settle(self) -> None:
        """Every rank calls it at the same point: raises `RankFault` on all when any rank faulted."""
        if self.world == 1:
            return
        flag = self._all_reduce(torch.tensor([0.0 if self.error is None else 1.0], dtype=torch.float32))
        if float(flag[0]) == 0.0:
            return
        if self.error is None:
            raise RankFault("the Blend forward failed on another tensor-parallel rank")
        stage, exc = self.error
        raise RankFault(f"the Blend forward's {stage} failed on this rank: {type(exc).__name__}: {exc}") from exc
