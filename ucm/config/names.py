"""The configuration's vocabulary: its keys, the per-request parameters, the policies and defaults.

Kept apart from the parsers so the connector, the benchmarks and the docs test read one list.
"""

from __future__ import annotations

from ucm.sparse.blend.vocabulary import Selection

CONFIG_FILE_KEY = "UCM_CONFIG_FILE"  # both the env var and the key inside the extra config
EXTRA_NAME = "kv_connector_extra_config"
# Top-level keys this module understands; anything else is kept in `UCMConfig.extra` and warned about.
# Exact-prefix loads complete between steps, vLLM's WAITING_FOR_REMOTE_KVS path (background_loads.py):
# always, never, or "auto" (while the store's reads are slow: a step-long wait otherwise costs more
# than a fast read).
ASYNC_PREFIX_LOADS_KEY = "async_prefix_loads"
PREFETCH_CHUNKS_KEY = "prefetch_chunks"
# A Blend step's chunk KV read layer group by layer group while its forward runs (UCM's key of that
# name): layer i+1's read overlaps layer i's compute (connector/layerwise_loads.py).
LAYERWISE_KEY = "use_layerwise"
KNOWN_TOP_LEVEL_KEYS = frozenset({"ucm_connectors", "ucm_sparse_config", CONFIG_FILE_KEY, ASYNC_PREFIX_LOADS_KEY,
                                  PREFETCH_CHUNKS_KEY, LAYERWISE_KEY})
# Top-level keys of UCM's own connector config that mean nothing here: accepted, with a note, so a
# config written for UCM runs unchanged.
UCM_NO_EFFECT_TOP_LEVEL_KEYS = frozenset({"load_only_first_rank", "metrics_config_path"})

# How Blend ranks the loaded tokens it recomputes (compute_meta[...]["selection"]): "query" weighs
# each token's deviation by the attention the question pays it (ucm/sparse/blend/query_probe.py);
# "hkvd" is CacheBlend's deviation-only rule; "oracle" is a diagnostic, slower than full prefill:
# it runs a full prefill first and ranks by what that shows (query_probe.oracle_layer_score), a
# reference for how well a ranking could do at a given ratio.
# (ucm/sparse/blend/vocabulary.py defines them; these are their public names.)
QUERY_SELECTION = Selection.QUERY.label
HKVD_SELECTION = Selection.HKVD.label
ORACLE_SELECTION = Selection.ORACLE.label
BLEND_SELECTIONS = Selection.labels()

# Per-request parameters, in SamplingParams(extra_args={"kv_transfer_params": {...}}) or the OpenAI
# server's `kv_transfer_params` (ucm_sparse_config.Blend.request_params says which are honoured):
CHUNK_LENGTHS_PARAM = "ucm_chunk_lengths"  # chunk lengths in tokens, for chunks without a marker token
DISABLE_BLEND_PARAM = "ucm_disable_blend"  # computed in full (chunks still stored; prefix caching on)
RATIO_PARAM = "ucm_blend_ratio"  # recompute ratio in [0, 1]
SELECTION_PARAM = "ucm_blend_selection"  # one of BLEND_SELECTIONS
# false: the store's exact prefix is left unused, so the request blends from its first chunk
# (benchmarks and tests measure Blend alone with it; vLLM's own prefix cache is not affected).
EXACT_PREFIX_PARAM = "ucm_exact_prefix"
# Which missed chunks are stored (ucm_sparse_config.Blend.chunk_store): "any" stores a chunk's KV
# from whatever prompt first computed it, so the text before it shapes what later requests reuse;
# "alone" stores only chunks computed with nothing before them (a prompt's first chunk, e.g. an
# indexing request that sends the chunk by itself), so no user's text shapes another's reuse.
CHUNK_STORE_POLICIES = ("any", "alone")
CHUNK_START_TOKENS_PARAM = "ucm_chunk_start_tokens"  # tokens per loaded chunk recomputed before any ranking
KV_SHIFT_DEFAULT = 0.5  # compute_meta kv_shift when absent: half the chunk mean (docs/research.md, "A share of the mean")
# ucm_sparse_config.Blend.min_hit_share when absent: a request blends only when at least this share of
# its tokens after the exact prefix has chunk KV stored (fewer hits: vLLM computes it as usual).
MIN_HIT_SHARE_DEFAULT = 0.25
# Default cap on a step's Blend rows, per token of vLLM's step budget: with the server's 2048 on CPU,
# 8192 rows hold a whole 6k-token RAG region (misses and question included) in one step, so a
# blended request is rarely cut and loses no reuse (docs/serving.md, "Bounded steps").
STEP_CAP_PER_BUDGET = 4
KV_SHIFT_PARAM = "ucm_kv_shift"  # share in [0, 1] of its chunk's mean error the reused KV is moved by (kv_shift.py)
# Share of every loaded chunk's tokens, evenly spaced, recomputed within the ratio to estimate the KV shift alone
# (an unbiased sample of the chunk; 0: the shift is estimated from the ranked tokens).
KV_SHIFT_SAMPLE_PARAM = "ucm_kv_shift_sample"
KV_SHIFT_SAMPLE_DEFAULT = 0.0
# true: store the request's KV on its first sighting, as an indexing request's (ucm_sparse_config.Blend.admission).
INDEX_PARAM = "ucm_index"
REQUEST_PARAMS = (CHUNK_LENGTHS_PARAM, DISABLE_BLEND_PARAM, RATIO_PARAM, SELECTION_PARAM, EXACT_PREFIX_PARAM,
                  CHUNK_START_TOKENS_PARAM, KV_SHIFT_PARAM, KV_SHIFT_SAMPLE_PARAM, INDEX_PARAM)

# The keys of ucm_sparse_config.Blend and of one compute_meta entry (docs/configuration.md lists each).
BLEND_KEYS = frozenset({"chunk_end_token_id", "chunk_separator", "compute_meta", "max_step_tokens", "request_params", "allow_oracle",
                        "chunk_store", "min_hit_share", "chunk_refs", "background_chunks", "admission"})
LAYER_META_KEYS = frozenset({"ratio", "selection", "chunk_start_tokens", "kv_shift", "kv_shift_sample"})

