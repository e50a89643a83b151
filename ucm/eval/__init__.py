"""Full prefill against Blend on one engine: TTFT, answer quality and cache counters.

Shared by the main job (examples/offline_inference_blend.py) and the benchmark
(benchmarks/blend_bench.py): modes.py (what is compared), engine.py (arguments, engines, store
directories), measure.py (the requests), summary.py (statistics, tables, JSON); datasets.py,
prompts.py and metrics.py below them. Per question:

1. Indexing: every passage is prefilled once on its own, as ``[system][passage]`` (what a RAG
   system's indexing step would do), which stores the KV of each chunk. These requests are
   batched and not timed as answers.
2. Each mode answers the whole prompt (system, passages in the data set's order, question), one
   request at a time, back to back:
   * full prefill: ``ucm_disable_blend`` (no chunk reuse);
   * Blend at ratio r: the chunks' stored KV is loaded and r of the loaded tokens are recomputed
     after the check layer (r = 0: full reuse, r = 1: recompute all of them).
   Before every measured request vLLM's local prefix cache is emptied, and the request leaves
   the store's exact prefix unused (``ucm_exact_prefix: false``): a mode is never helped by an
   earlier mode of the same question, and Blend reuses chunk KV only. All requests run under no
   ``cache_salt`` (one tenant): chunk KV is shared exactly where a prefix could be.

Every request states its chunks (system message and passages) in ``ucm_chunk_lengths``, so the
question is the prompt's suffix, recomputed by every mode as a user's new question would be.
Split at the marker instead, the question message (which ends with <|im_end|> as well) would be a
chunk of its own: the first Blend mode of a question would store it and every later mode would
reuse its KV, so the modes would not be measured alike.

Nothing here imports vLLM at module level; engines are built by the callers' main processes.
"""
