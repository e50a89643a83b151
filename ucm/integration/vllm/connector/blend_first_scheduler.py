"""vLLM's scheduler, with a step that admits a blend request kept short for it.

vLLM schedules its running requests before it looks at the waiting queue: a blend request whose
chunks are in the store (about a quarter of a full prefill's work) shares its step with up to
`long_prefill_token_threshold` rows of every running prefill, and waits for them. This subclass
asks the connector about the head of the waiting queue first; when it would blend, the running
prefills get at most BLEND_STEP_SHARE tokens each in that one step (shortest job first, for one
step). Opt in with `--scheduler-cls ucm.integration.vllm.connector.blend_first_scheduler.BlendFirstScheduler`.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

# Tokens each running prefill keeps in a step that admits a blend request: one block.
BLEND_STEP_SHARE = 128


class BlendFirstScheduler(Scheduler):
    def schedule(self, *args, **kwargs):
        side = getattr(self.connector, "scheduler_side", None)
        if side is None or not self.running or not self.waiting or not side.plans_blend(self.waiting.peek_request()):
            return super().schedule(*args, **kwargs)
        config = self.scheduler_config
        saved = config.long_prefill_token_threshold
        config.long_prefill_token_threshold = min(saved or BLEND_STEP_SHARE, BLEND_STEP_SHARE)
        side.stats.add("blend_first_steps")
        try:
            return super().schedule(*args, **kwargs)
        finally:
            config.long_prefill_token_threshold = saved
