"""vLLM's scheduler, with the step that admits a blend request kept short for it.

vLLM schedules its running requests before it looks at the waiting queue, and the waiting queue
first come, first served: a blend request whose chunks are in the store (about a quarter of a full
prefill's work) shares its step with `long_prefill_token_threshold` rows of every running prefill
and waits behind every request that arrived before it. This subclass asks the connector about the
first BLEND_LOOKAHEAD waiting requests first (vLLM's own question later uses the plan made for
it, while that is fresh). The first that would blend moves to the head of the queue (FCFS policy
only), and in that step every other prefill, running or waiting, gets at most BLEND_STEP_SHARE
tokens: shortest job first, one step at a time, at most MAX_SHORT_STEPS_IN_ROW steps in a row.
Decodes keep their token.

The default scheduler of `ucm-vllm serve` and of `make_llm` when Blend is on (`default_scheduler_cls`);
`--scheduler-cls` chooses another. It subclasses vLLM's synchronous `Scheduler`, so it is not used
where vLLM would schedule asynchronously (GPUs, by default).
"""

from __future__ import annotations

from itertools import islice

from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

# Tokens every other prefill keeps in a step that admits a blend request. vLLM reads a threshold
# of 0 as "no limit", so the smallest share is one token.
BLEND_STEP_SHARE = 1
# Short steps in a row at most: then one step of vLLM's own, so a stream of blend requests
# cannot starve the prefills it holds back.
MAX_SHORT_STEPS_IN_ROW = 4
# Waiting requests asked about per step; a request's plan (its store lookups) is kept for
# scheduler_side.HELD_PLAN_SECONDS and used by vLLM's own question.
BLEND_LOOKAHEAD = 8
QUALNAME = f"{__name__}.BlendFirstScheduler"


class BlendFirstScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._last_first: str | None = None  # the request the last short step was for
        self._short_in_row = 0

    def schedule(self, *args, **kwargs):
        if self._short_in_row >= MAX_SHORT_STEPS_IN_ROW or not self._blend_request_first():
            self._short_in_row = 0
            return super().schedule(*args, **kwargs)
        self._short_in_row += 1
        config = self.scheduler_config
        saved = config.long_prefill_token_threshold
        config.long_prefill_token_threshold = BLEND_STEP_SHARE
        self.connector.scheduler_side.stats.add("blend_first_steps")
        try:
            return super().schedule(*args, **kwargs)
        finally:
            config.long_prefill_token_threshold = saved

    def _blend_request_first(self) -> bool:
        """Puts the first waiting request that would blend at the head of the queue; True when
        there is one and another request shares the step with it."""
        side = getattr(self.connector, "scheduler_side", None)
        if (side is None or not self.waiting or len(self.running) + len(self.waiting) < 2
                or len(self.running) >= self.max_num_active_reqs):
            return False  # nothing to hold back, or no room to admit it
        # Only a FCFS queue is reordered; a priority queue is only asked about its head (and its
        # iterator copies the whole heap).
        fcfs = self.policy == SchedulingPolicy.FCFS
        for i, request in enumerate(islice(self.waiting, BLEND_LOOKAHEAD) if fcfs else [self.waiting.peek_request()]):
            if request.status == RequestStatus.WAITING and side.plans_blend(request):
                if i > 0:
                    self.waiting.remove_request(request)
                    self.waiting.prepend_request(request)
                    side.stats.add("blend_first_reorders")
                if request.request_id == self._last_first:
                    return False  # not admitted in its short step (LoRA slots, ...): a normal step
                self._last_first = request.request_id
                return True
        return False


def is_blend_first(scheduler_cls) -> bool:
    """Whether vLLM's scheduler_cls setting (a qualified name or a class) is this scheduler."""
    if isinstance(scheduler_cls, type):
        return issubclass(scheduler_cls, BlendFirstScheduler)
    return scheduler_cls == QUALNAME


def blend_configured(kv_transfer_config) -> bool:
    """Whether a KVTransferConfig (or its dict form) turns on the UCM connector with Blend."""
    get = kv_transfer_config.get if isinstance(kv_transfer_config, dict) else \
        lambda name: getattr(kv_transfer_config, name, None)
    if kv_transfer_config is None or get("kv_connector") != "UCMConnector":
        return False
    sparse = (get("kv_connector_extra_config") or {}).get("ucm_sparse_config") or {}
    return isinstance(sparse, dict) and "Blend" in sparse


def default_scheduler_cls(kv_transfer_config, scheduler_cls, async_scheduling: bool | None) -> str | None:
    """The scheduler class to set when the user chose none: BlendFirstScheduler with Blend on,
    unless vLLM would schedule asynchronously (our class is synchronous; on CPU vLLM never does)."""
    if scheduler_cls is not None or async_scheduling or not blend_configured(kv_transfer_config):
        return None
    if async_scheduling is None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
    return QUALNAME
