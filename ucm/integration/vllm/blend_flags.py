"""Blend turned on the way the vLLM Blend plugin's users do it, without the JSON.

`ucm-vllm serve MODEL --enable-blend [--blend-check-layers 1] [--blend-recompute-ratios 0.3]
[--blend-store DIR] [--blend-chunk-end-token-id ID | --blend-separator TEXT]` is rewritten to
`--kv-transfer-config` with the README's connector config, and `blend_transfer_config` gives the
same to Python (`LLM(..., kv_transfer_config=KVTransferConfig(**blend_transfer_config(...)))`).
A separator of several tokens (LMCache's `" # # "`) becomes `chunk_separator`, its token ids.
What we do not support yet is refused with an error naming the flag: several check layers
(CacheBlend's gradual filtering).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ucm.config import UCMConfig, UCMConfigError, attn_layer_name
from ucm.integration.vllm.llm import ucm_transfer_dict

ENABLE = "--enable-blend"
CHECK_LAYERS = "--blend-check-layers"
RATIOS = "--blend-recompute-ratios"
STORE = "--blend-store"
TOKEN = "--blend-chunk-end-token-id"
SEPARATOR = "--blend-separator"
VALUE_FLAGS = (CHECK_LAYERS, RATIOS, STORE, TOKEN, SEPARATOR)
DEFAULT_STORE = "/tmp/ucm-kvcache"  # the README's
DEFAULT_CHECK_LAYER, DEFAULT_RATIO = 1, 0.3
CHATML_END = "<|im_end|>"  # ends every chat message of ChatML models: each message is a chunk


def blend_transfer_config(store_dir: str | Path = DEFAULT_STORE, chunk_end_token_id: int | None = None,
                          check_layers: Sequence[int] = (DEFAULT_CHECK_LAYER,),
                          recompute_ratios: Sequence[float] = (DEFAULT_RATIO,),
                          chunk_separator: Sequence[int] | str | None = None) -> dict[str, Any]:
    """The kv_transfer_config (a dict, as `--kv-transfer-config` takes it) of Blend on one store
    directory. The plugin's lists: check layers (several: CacheBlend's gradual filtering, the
    selection narrowing at each), and one ratio for all of them or one per layer; chunks end with
    `chunk_end_token_id` or with `chunk_separator` (token ids, or text the engine tokenizes)."""
    if chunk_end_token_id is not None and chunk_separator is not None:
        raise UCMConfigError("give a chunk end token id or a chunk separator, not both")
    if not check_layers:
        raise UCMConfigError(f"{CHECK_LAYERS}: give at least one layer, e.g. {DEFAULT_CHECK_LAYER}")
    if len(recompute_ratios) not in (1, len(check_layers)):
        raise UCMConfigError(f"{RATIOS} {' '.join(map(str, recompute_ratios))}: give one ratio, or one per check "
                             f"layer ({len(check_layers)})")
    ratios = list(recompute_ratios) * len(check_layers) if len(recompute_ratios) == 1 else list(recompute_ratios)
    pairs = sorted(zip(check_layers, ratios))
    separator = None if chunk_separator is None else {
        "chunk_separator": chunk_separator if isinstance(chunk_separator, str) else [int(t) for t in chunk_separator]}
    # chunk_end_token_id and chunk_separator None: chunks by per-request lengths only
    return ucm_transfer_dict(store_dir, pairs[0][1], chunk_end_token_id, attn_layer_name(pairs[0][0]),
                             blend_options=separator, later_checks=pairs[1:])


def _take(argv: list[str], flag: str) -> list[str] | None:
    """The values after `flag` (up to the next flag), removed from argv; None when absent."""
    for i, arg in enumerate(argv):
        if arg == flag or arg.startswith(flag + "="):
            if "=" in arg:
                values, end = [arg.split("=", 1)[1]], i + 1
            else:
                end = i + 1
                while end < len(argv) and not (argv[end].startswith("--") and len(argv[end]) > 2):
                    end += 1
                values = argv[i + 1:end]
            if not values:
                raise UCMConfigError(f"{flag} needs a value")
            del argv[i:end]
            return values
    return None


def _numbers(flag: str, values: list[str], kind: type) -> list:
    try:
        return [kind(v) for v in values]
    except ValueError:
        raise UCMConfigError(f"{flag} takes {kind.__name__}s, got {' '.join(values)!r}") from None


def _num_layers(model: str) -> int | None:
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    return data.get("num_hidden_layers") or data.get("text_config", {}).get("num_hidden_layers")


def _chunk_end(model: str | None, token: list[str] | None, separator: list[str] | None) -> tuple[int | None,
                                                                                             list[int] | None]:
    """(the chunk end token, the separator's token ids): the token given, the separator text
    tokenized by the model's tokenizer (one token: the chunk end token), or ChatML's <|im_end|>."""
    if token is not None:
        if len(token) != 1:
            raise UCMConfigError(f"{TOKEN} takes one token id, got {' '.join(token)!r}")
        return _numbers(TOKEN, token, int)[0], None
    if model is None:
        raise UCMConfigError(f"{ENABLE} without a model to read the chunk end token from: give {TOKEN}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if separator is not None:
        text = " ".join(separator)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise UCMConfigError(f"{SEPARATOR} {text!r} is no token for this model's tokenizer")
        return (ids[0], None) if len(ids) == 1 else (None, ids)
    if CHATML_END not in tokenizer.get_vocab():
        raise UCMConfigError(f"{ENABLE}: the model's vocabulary has no {CHATML_END}; give {TOKEN} (the id of the "
                             f"token that ends each chunk) or {SEPARATOR}")
    return tokenizer.convert_tokens_to_ids(CHATML_END), None


def translate_serve_flags(argv: list[str]) -> list[str]:
    """`serve` argv with the Blend flags replaced by the `--kv-transfer-config` they mean; other
    argv unchanged. A Blend flag without --enable-blend, or with --kv-transfer-config, is an error."""
    argv = list(argv)
    blend_flags = [a for a in argv if a == ENABLE or any(a == f or a.startswith(f + "=") for f in VALUE_FLAGS)]
    if argv[1:2] != ["serve"] or not blend_flags:
        return argv
    if ENABLE not in argv:
        raise UCMConfigError(f"{blend_flags[0]} needs {ENABLE}")
    if any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config=") for a in argv):
        raise UCMConfigError(f"{ENABLE} builds --kv-transfer-config: give one or the other")
    argv.remove(ENABLE)
    layers = _numbers(CHECK_LAYERS, _take(argv, CHECK_LAYERS) or [str(DEFAULT_CHECK_LAYER)], int)
    ratios = _numbers(RATIOS, _take(argv, RATIOS) or [str(DEFAULT_RATIO)], float)
    store = _take(argv, STORE)
    token, separator = _take(argv, TOKEN), _take(argv, SEPARATOR)
    if token is not None and separator is not None:
        raise UCMConfigError(f"give {TOKEN} or {SEPARATOR}, not both")
    model = argv[2] if len(argv) > 2 and not argv[2].startswith("-") else None
    num_layers = _num_layers(model) if model else None
    if num_layers is not None:
        for layer in layers:
            if not 0 <= layer < num_layers:
                raise UCMConfigError(f"{CHECK_LAYERS}: layer {layer} does not exist; this model has {num_layers} "
                                     f"layers (0 .. {num_layers - 1})")
    end_token, separator_ids = _chunk_end(model, token, separator)
    config = blend_transfer_config(store[0] if store else DEFAULT_STORE, end_token, layers, ratios, separator_ids)
    UCMConfig.from_extra_config(config["kv_connector_extra_config"])  # a bad ratio is named now, not in the engine
    return argv + ["--kv-transfer-config", json.dumps(config)]
