"""`ucm-vllm serve MODEL --enable-blend ...`: the vLLM Blend plugin's flags as our connector config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ucm.config import UCMConfig, UCMConfigError
from ucm.integration.vllm.blend_flags import blend_transfer_config, translate_serve_flags

README = Path(__file__).resolve().parents[3] / "README.md"


def readme_transfer_config() -> dict:
    """The --kv-transfer-config JSON of the README's quick-start `serve` command."""
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S) if "ucm-vllm serve" in b]
    return json.loads(re.search(r"--kv-transfer-config '(.*?)'", block, re.S).group(1).replace("\n", " "))


def serve(model_dir, *flags) -> list[str]:
    return translate_serve_flags(["ucm-vllm", "serve", str(model_dir), "--port", "8000", *flags])


def test_the_plugins_flags_build_the_readmes_config(model_dir):
    argv = serve(model_dir, "--enable-blend", "--blend-check-layers", "1", "--blend-recompute-ratios", "0.3",
                 "--blend-store", "/tmp/ucm-kvcache")
    assert argv[:5] == ["ucm-vllm", "serve", str(model_dir), "--port", "8000"]
    assert argv[5] == "--kv-transfer-config" and json.loads(argv[6]) == readme_transfer_config()
    # The defaults are the README's; <|im_end|> (id 2 here) ends each chunk.
    assert json.loads(serve(model_dir, "--enable-blend")[6]) == readme_transfer_config()
    assert blend_transfer_config("/tmp/ucm-kvcache", 2) == readme_transfer_config()
    # A one-token separator is that token, ending the chunk before it.
    assert json.loads(serve(model_dir, "--enable-blend", "--blend-separator", "<|im_end|>")[6]) == readme_transfer_config()


def test_a_separator_of_several_tokens_is_lmcaches_special_string(model_dir):
    """LMCache's " # # " is 3 tokens for this tokenizer: the config holds their ids as
    chunk_separator (no chunk end token), and the config code accepts it."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(" # # ", add_special_tokens=False)
    assert len(ids) == 3
    config = json.loads(serve(model_dir, "--enable-blend", "--blend-separator", " # # ")[6])
    blend = config["kv_connector_extra_config"]["ucm_sparse_config"]["Blend"]
    assert blend["chunk_separator"] == ids and blend["chunk_end_token_id"] is None
    assert UCMConfig.from_extra_config(config["kv_connector_extra_config"]).sparse.chunk_end == tuple(ids)
    with pytest.raises(UCMConfigError, match="not both"):
        blend_transfer_config("/tmp/s", 2, chunk_separator=ids)


def test_other_commands_and_argv_without_blend_flags_are_left_alone(model_dir):
    argv = ["ucm-vllm", "serve", str(model_dir), "--kv-transfer-config", "{}"]
    assert translate_serve_flags(argv) == argv
    assert translate_serve_flags(["ucm-vllm", "--version"]) == ["ucm-vllm", "--version"]


@pytest.mark.parametrize("flags, message", [
    (("--enable-blend", "--blend-check-layers", "0", "16", "32"), "layer 32 does not exist; this model has 30 layers"),
    (("--enable-blend", "--blend-check-layers", "1", "16", "--blend-recompute-ratios", "0.3", "0.2", "0.1"),
     "give one ratio, or one per check layer (2)"),
    (("--enable-blend", "--blend-recompute-ratios", "0.1", "0.2"), "give one ratio"),
    (("--enable-blend", "--blend-recompute-ratios", "1.5"), "ratio must be a number in [0, 1]"),
    (("--blend-check-layers", "1"), "--blend-check-layers needs --enable-blend"),
    (("--enable-blend", "--kv-transfer-config", "{}"), "give one or the other"),
    (("--enable-blend", "--blend-chunk-end-token-id", "x"), "takes ints"),
])
def test_what_is_not_supported_is_refused_by_name(model_dir, flags, message):
    with pytest.raises(UCMConfigError, match=re.escape(message)):
        serve(model_dir, *flags)


def test_the_command_line_names_a_check_layer_the_model_lacks(model_dir):
    """The plugin's README flags on the 30-layer embedded model: refused before vLLM starts."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ucm.integration.vllm.cli", "serve", str(model_dir), "--enable-blend",
                          "--blend-check-layers", "0", "16", "32", "--blend-recompute-ratios", "0.1"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 2
    assert "--blend-check-layers: layer 32 does not exist; this model has 30 layers (0 .. 29)" in out.stderr


def test_the_plugins_several_check_layers_are_gradual_filtering(model_dir):
    """`--blend-check-layers 1 16 29 --blend-recompute-ratios 0.3 0.2 0.1`: the first layer checks,
    the later ones narrow the selection to their ratio; one ratio for all layers keeps it."""
    config = json.loads(serve(model_dir, "--enable-blend", "--blend-check-layers", "1", "16", "29",
                              "--blend-recompute-ratios", "0.3", "0.2", "0.1")[6])
    blend = UCMConfig.from_extra_config(config["kv_connector_extra_config"]).sparse
    assert (blend.check_layer, blend.ratio, blend.later_checks) == (1, 0.3, ((16, 0.2), (29, 0.1)))
    config = json.loads(serve(model_dir, "--enable-blend", "--blend-check-layers", "0", "16",
                              "--blend-recompute-ratios", "0.1")[6])
    blend = UCMConfig.from_extra_config(config["kv_connector_extra_config"]).sparse
    assert (blend.check_layer, blend.ratio, blend.later_checks) == (0, 0.1, ((16, 0.1),))
