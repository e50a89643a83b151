"""vLLM's scheduler, with the step that admits a blend request kept short for it.

vLLM schedules its running requests before it looks at the waiting queue, and the waiting queue
first come, first served: a blend request whose chunks are in the store (about a quarter of a full
prefill's work) shares its step with `long_prefill_token_threshold` rows of every running prefill
and waits behind every request that arrived before it. This subclass asks the connector about the
first BLEND_LOOKAHEAD waiting requests first (vLLM's own question later uses the plan made for
it, while that is fresh). The first that would blend with a short region (its Blend work, in rows,
at most SHORT_REGION_BUDGETS of vLLM's step budget) moves to the head of the queue (FCFS policy
only), and in that step every other prefill, running or waiting, gets at most BLEND_STEP_SHARE
tokens: shortest job first, one step at a time, at most MAX_SHORT_STEPS_IN_ROW steps in a row.
Decodes keep their token, and other blend requests join the step while its Blend work stays
within that bound. A blend request with a longer region (many misses) is no short job: it keeps its
place, as under vLLM's scheduler, so that the prefills it would hold back do not wait for it
(docs/research.md, "Where the stream's time goes, and only short regions first"). But it is not
admitted into a step with a prefill (running, or waiting before it) that has fewer prompt tokens
left than its region has rows (at most MAX_HELD_STEPS_IN_ROW steps in a row): its region runs
beside vLLM's budget, so that prefill's first token would wait for the whole region; held, the
shorter job ends first and the blend request's own first token comes no later.
A prefill that short steps hold back is passed by at most MAX_PASSES_PER_PREFILL blend requests:
in a closed loop blended requests end early and the clients' next ones bunch, and a miss passed by
each of them made the stream's tail (docs/research.md, "A prefill passed once"). The next blend
request keeps its place, and while such a prefill runs no Blend region joins its steps (one would
lengthen them as much as a pass): the region waits for the prefill's prompt to be done.

The default scheduler of `ucm-vllm serve` and of `make_llm` when Blend is on (`default_scheduler_cls`);
`--scheduler-cls` chooses another. It subclasses vLLM's synchronous `Scheduler`, so it is not used
where vLLM would schedule asynchronously (GPUs, by default).

It also computes the chunks requests missed alone while no user request is waiting or running
(the connector's `background_chunks` queue, on under the "alone" chunk-store policy): one chunk at
a time, as a request of its own whose output no client sees, in steps of at most
BACKGROUND_STEP_TOKENS tokens; a user request's arrival stops it and queues the chunk again.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from itertools import islice

from vllm import SamplingParams
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from ucm.integration.vllm.connector.background_chunks import BackgroundChunk
from ucm.integration.vllm.vllm_names import Need, missing, refusal, require

logger = logging.getLogger(__name__)

# Tokens every other prefill keeps in a step that admits a blend request. vLLM reads a threshold
# of 0 as "no limit", so the smallest share is one token.
BLEND_STEP_SHARE = 1
# A waiting blend request goes first only if its region runs at most this many of vLLM's step
# budgets of rows (about the time of one of vLLM's steps): a request with most of its chunks hit.
SHORT_REGION_BUDGETS = 1.0
# Short steps in a row at most: then one step of vLLM's own, so a stream of blend requests
# cannot starve the prefills it holds back.
MAX_SHORT_STEPS_IN_ROW = 4
# Blend requests that may go before a given prefill (running, or waiting ahead of them), over its life.
MAX_PASSES_PER_PREFILL = 1
# Steps in a row a long region at the head of the queue waits for a running prefill that ends
# sooner: the prefill gets vLLM's budget each step, so it ends within step_cap / budget steps
# unless others share the budget; the bound keeps the held request from starving.
MAX_HELD_STEPS_IN_ROW = 8
# Waiting requests asked about per step; a request's plan (its store lookups) is kept for
# scheduler_side.HELD_PLAN_SECONDS and used by vLLM's own question.
BLEND_LOOKAHEAD = 8
# Tokens per step of a chunk computed in the background: a user request that arrives waits for
# the step in flight, so these steps are short (~0.1 of a 2048-token step's time).
BACKGROUND_STEP_TOKENS = 256
QUALNAME = f"{__name__}.BlendFirstScheduler"


class BlendFirstScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        require({Need.BLEND_FIRST})  # vLLM's scheduler internals it relies on (vllm_names.py)
        super().__init__(*args, **kwargs)
        self._last_first: str | None = None  # the request the last short step was for
        self._short_in_row = 0
        self._held_in_row = 0  # steps in a row no request was admitted for a prefill about to end
        self._passes: Counter[str] = Counter()  # prefill's request id -> blend requests that went before it
        self._background: dict[str, BackgroundChunk] = {}  # request id -> its chunk, in the engine now
        self._background_prefix = f"ucm-background-{uuid.uuid4().hex[:8]}-"
        self._background_sent = 0

    def add_request(self, request: Request) -> None:
        if self._background and not request.request_id.startswith(self._background_prefix):
            self._stop_background()
        super().add_request(request)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self._hide_background(outputs)
        self._start_background()
        return outputs

    def schedule(self, *args, **kwargs):
        if self._background:  # a user request would have stopped it: only it is in the engine
            saved = self.max_num_scheduled_tokens
            self.max_num_scheduled_tokens = min(saved, BACKGROUND_STEP_TOKENS)
            try:
                return super().schedule(*args, **kwargs)
            finally:
                self.max_num_scheduled_tokens = saved
        if self._short_in_row >= MAX_SHORT_STEPS_IN_ROW or not self._blend_request_first():
            self._short_in_row = 0
            if self._passed_prefill_runs():  # no blend request joins its steps
                return self._step_holding_over(0, "blend_first_yields", *args, **kwargs)
            hold_over = self._rows_to_hold_over()
            if hold_over:
                self._held_in_row += 1
                return self._step_holding_over(hold_over, "blend_holds", *args, **kwargs)
            self._held_in_row = 0
            return super().schedule(*args, **kwargs)
        self._held_in_row = 0
        self._short_in_row += 1
        config, side = self.scheduler_config, self.connector.scheduler_side
        saved, saved_cap = config.long_prefill_token_threshold, side.admit_cap
        config.long_prefill_token_threshold = BLEND_STEP_SHARE
        # Other blend requests join the step only while its Blend work stays short.
        side.admit_cap = min(saved_cap, self._short_region_rows())
        side.stats.add("blend_first_steps")
        try:
            return super().schedule(*args, **kwargs)
        finally:
            config.long_prefill_token_threshold, side.admit_cap = saved, saved_cap

    def _step_holding_over(self, hold_over: int, counter: str, *args, **kwargs):
        """vLLM's step in which no blend request with more than ``hold_over`` rows of Blend work is
        admitted (0: none): a prefill that ends sooner, or one passed as often as allowed, runs
        without a region beside it."""
        side = self.connector.scheduler_side
        side.stats.add(counter)
        side.hold_over = hold_over
        try:
            return super().schedule(*args, **kwargs)
        finally:
            side.hold_over = None

    def _running_prefills(self) -> list[str]:
        return [r.request_id for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]

    def _passed_prefill_runs(self) -> bool:
        """Whether a running prefill was passed MAX_PASSES_PER_PREFILL times and a request waits."""
        if not self._passes or self._side_if_contended() is None:
            return False
        return any(self._passes[r] >= MAX_PASSES_PER_PREFILL for r in self._running_prefills())

    def _blend_request_first(self) -> bool:
        """Puts the first waiting request that would blend with a short region at the head of the
        queue; True when there is one and another request shares the step with it."""
        side = self._side_if_contended()
        if side is None:
            return False
        short = self._short_region_rows()
        for i, request in enumerate(self._looked_ahead()):
            work = side.planned_blend_work(request) if request.status == RequestStatus.WAITING else 0
            if 0 < work <= short:  # a longer region blends in its turn, as under vLLM's scheduler
                if request.request_id == self._last_first:
                    return False  # not admitted in its short step (LoRA slots, ...): a normal step
                passed = self._prefills_before(i)
                if any(self._passes[r] >= MAX_PASSES_PER_PREFILL for r in passed):
                    return False  # it keeps its place
                if i > 0:
                    self.waiting.remove_request(request)
                    self.waiting.prepend_request(request)
                    side.stats.add("blend_first_reorders")
                self._passes.update(passed)
                self._last_first = request.request_id
                return True
        return False

    def _prefills_before(self, index: int) -> list[str]:
        """The prefills a short step for the waiting request at ``index`` holds back: the running
        ones with prompt left and the waiting requests ahead of it."""
        if len(self._passes) > 4 * self.max_num_running_reqs:  # forget requests that ended
            self._passes = Counter({r: n for r, n in self._passes.items() if r in self.requests})
        return self._running_prefills() + [r.request_id for r in islice(self._looked_ahead(), index)]

    def _rows_to_hold_over(self) -> int:
        """When the first longer region in the queue would share its step with a prefill (running,
        or waiting before it) that has fewer prompt tokens left than the region has rows: those
        tokens, the Blend work above which a request waits this step. Else 0."""
        side = self._side_if_contended()
        if side is None or self._held_in_row >= MAX_HELD_STEPS_IN_ROW:
            return 0
        ahead = [r.num_prompt_tokens - r.num_computed_tokens for r in self.running]
        for request in self._looked_ahead():
            work = side.planned_blend_work(request) if request.status == RequestStatus.WAITING else 0
            if work:
                left = min((n for n in ahead if n > 0), default=work)
                return left if left < work else 0
            ahead.append(request.num_prompt_tokens - request.num_computed_tokens)
        return 0

    def _side_if_contended(self):
        """The connector's scheduler side when a waiting request could be admitted beside another."""
        side = getattr(self.connector, "scheduler_side", None)
        if (side is None or not self.waiting or len(self.running) + len(self.waiting) < 2
                or len(self.running) >= self.max_num_active_reqs):
            return None  # nothing to hold back, or no room to admit it
        return side

    def _looked_ahead(self):
        # Only a FCFS queue is reordered; a priority queue is only asked about its head (and its
        # iterator copies the whole heap).
        if self.policy == SchedulingPolicy.FCFS:
            return islice(self.waiting, BLEND_LOOKAHEAD)
        return [self.waiting.peek_request()]

    def _short_region_rows(self) -> int:
        return int(SHORT_REGION_BUDGETS * self.max_num_scheduled_tokens)

    # ---- chunks computed alone in the background ----------------------------------------

    def _start_background(self) -> None:
        """Sends the next queued chunk that is not stored yet, when no user request is in the engine."""
        side = getattr(self.connector, "scheduler_side", None)
        queue = getattr(side, "background", None)
        if not queue or self._background or any(not r.is_finished() for r in self.requests.values()):
            return
        while (chunk := queue.take()) is not None:
            if side.stored(chunk.last_hash, chunk.lora_request):
                side.stats.add("background_chunks_skipped")
                continue
            self._background_sent += 1
            request = Request(f"{self._background_prefix}{self._background_sent}", list(chunk.token_ids),
                              SamplingParams(max_tokens=1, temperature=0.0, extra_args=(
                                  {"kv_transfer_params": chunk.kv_transfer_params} if chunk.kv_transfer_params else None)),
                              None, lora_request=chunk.lora_request,
                              cache_salt=chunk.cache_salt, block_hasher=chunk.block_hasher)
            self._background[request.request_id] = chunk
            Scheduler.add_request(self, request)
            side.stats.add("background_chunks_started")
            return

    def _stop_background(self) -> None:
        side = self.connector.scheduler_side
        for chunk in self._background.values():
            side.background.put_back(chunk)
            side.stats.add("background_chunks_stopped")
        Scheduler.finish_requests(self, list(self._background), RequestStatus.FINISHED_ABORTED)
        self._background.clear()

    def _hide_background(self, outputs) -> None:
        """Counts finished background chunks and takes their outputs out of what clients receive."""
        prefix = self._background_prefix
        for engine_outputs in outputs.values():
            if self._background:
                engine_outputs.outputs = [o for o in engine_outputs.outputs if not o.request_id.startswith(prefix)]
            if engine_outputs.finished_requests:
                engine_outputs.finished_requests = {r for r in engine_outputs.finished_requests
                                                    if not r.startswith(prefix)}
        for req_id in [r for r in self._background if r not in self.requests or self.requests[r].is_finished()]:
            del self._background[req_id]
            self.connector.scheduler_side.stats.add("background_chunks_computed")


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
    lacking = missing({Need.BLEND_FIRST})
    if lacking:  # vLLM's own scheduler then: Blend works, without admitting blend requests first
        logger.warning("%s", refusal(lacking, {Need.BLEND_FIRST}))
        return None
    return QUALNAME
