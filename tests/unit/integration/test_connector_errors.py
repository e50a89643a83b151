"""UCMConnector start-up checks on a real VllmConfig (no engine is started).

vLLM builds its connectors from `VllmConfig` in the scheduler process (role SCHEDULER) and in
every worker (role WORKER); whatever a user gets wrong must fail right there, with a message
naming the offending key, directory, RoPE type or architecture. Configs are built from the
prepared model's directory, or from copies of its config.json and tokenizer with one field
changed (and dummy weights, which config creation never reads).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
NUM_LAYERS, VOCAB = 30, 49152
ROLES = ("SCHEDULER", "WORKER")


@pytest.fixture(scope="module", autouse=True)
def _cpu_kv_cache_space():
    # vLLM's CPU platform wants a KV cache size; config creation only records it.
    with pytest.MonkeyPatch.context() as mp:
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        yield


def blend_section(layer=1, ratio=0.15, chunk_end_token_id=2):
    return {"Blend": {"chunk_end_token_id": chunk_end_token_id,
                      "compute_meta": {f"model.layers.{layer}.self_attn.attn": {"ratio": ratio}}}}


def extra_config(store, blend=True, **blend_kw):
    extra = {"ucm_connectors": [{"ucm_connector_name": "UcmNfsStore",
                                 "ucm_connector_config": {"storage_backends": str(store)}}]}
    if blend:
        extra["ucm_sparse_config"] = blend_section(**blend_kw)
    return extra


def vllm_config(model, extra, **engine_kw):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    kv = KVTransferConfig(kv_connector="UCMConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    return EngineArgs(model=str(model), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                      kv_transfer_config=kv, **engine_kw).create_engine_config()


def connector(config, role: str):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from ucm.integration.vllm.connector.ucm_connector import UCMConnector

    return UCMConnector(config, KVConnectorRole[role], kv_cache_config=None)


def build_and_close(config, role: str):
    c = connector(config, role)
    c.shutdown()  # closes the store (and its housekeeping thread)
    return c


def copied_model(model_dir, dest, **config_changes):
    """config.json + tokenizer of the prepared model, no weights, with `config_changes` applied."""
    dest.mkdir()
    for name in MODEL_FILES:
        shutil.copy(model_dir / name, dest / name)
    config = json.loads((dest / "config.json").read_text())
    config.update(config_changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


# ---- a valid config --------------------------------------------------------------------------


def test_scheduler_sets_kv_load_failure_policy_to_recompute(model_dir, tmp_path):
    config = vllm_config(model_dir, extra_config(tmp_path / "store"))
    assert config.kv_transfer_config.kv_load_failure_policy == "fail"  # vLLM's default
    build_and_close(config, "SCHEDULER")
    # vLLM's scheduler reads it right after building the connector: a failed load is recomputed.
    assert config.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_blend_leaves_room_in_each_step_for_blend_requests(model_dir, tmp_path):
    """A running long prefill takes at most the budget less an eighth, so a blend request waiting
    behind it (one scheduled token) gets the next step; vLLM's scheduler reads the threshold at
    every step from this same SchedulerConfig."""
    config = vllm_config(model_dir, extra_config(tmp_path / "store"))
    budget = config.scheduler_config.max_num_batched_tokens
    assert config.scheduler_config.long_prefill_token_threshold == 0  # vLLM's default
    build_and_close(config, "SCHEDULER")
    assert config.scheduler_config.long_prefill_token_threshold == budget - budget // 8


@pytest.mark.parametrize("case", ["user_set", "no_blend", "producer", "blend_first"])
def test_long_prefill_threshold_is_left_alone(model_dir, tmp_path, case):
    """BlendFirstScheduler admits blend requests itself: a threshold would only make the prefills
    that share a step slower (docs/serving.md)."""
    from ucm.integration.vllm.connector.blend_first_scheduler import QUALNAME

    engine_kw = {"long_prefill_token_threshold": 512} if case == "user_set" else {}
    if case == "blend_first":
        engine_kw["scheduler_cls"] = QUALNAME
    config = vllm_config(model_dir, extra_config(tmp_path / "store", blend=case != "no_blend"), **engine_kw)
    if case == "producer":
        config.kv_transfer_config.kv_role = "kv_producer"
    build_and_close(config, "SCHEDULER")
    assert config.scheduler_config.long_prefill_token_threshold == (512 if case == "user_set" else 0)


def test_vllm_factory_builds_the_connector_by_name(model_dir, tmp_path):
    """The `vllm.general_plugins` entry point registers "UCMConnector"; no module path is needed."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.plugins import load_general_plugins

    from ucm.integration.vllm.connector.ucm_connector import UCMConnector

    load_general_plugins()
    config = vllm_config(model_dir, extra_config(tmp_path / "store"))
    assert config.kv_transfer_config.kv_connector_module_path is None
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        c = KVConnectorFactory.create_connector(config, role, None)
        assert isinstance(c, UCMConnector)
        c.shutdown()


def test_last_layer_as_check_layer_is_accepted(model_dir, tmp_path):
    config = vllm_config(model_dir, extra_config(tmp_path / "store", layer=NUM_LAYERS - 1))
    for role in ROLES:
        build_and_close(config, role)


# ---- bad keys and values: the message names the key ---------------------------------------------

LAYER_1 = '["model.layers.1.self_attn.attn"]'


def _set_ratio(extra):
    extra["ucm_sparse_config"]["Blend"]["compute_meta"]["model.layers.1.self_attn.attn"]["ratio"] = 1.5


def _mlp_key(extra):
    extra["ucm_sparse_config"]["Blend"]["compute_meta"] = {"model.layers.1.mlp": {"ratio": 0.2}}


def _layer_30(extra):
    extra["ucm_sparse_config"] = blend_section(layer=NUM_LAYERS)


def _token_outside_vocab(extra):
    extra["ucm_sparse_config"]["Blend"]["chunk_end_token_id"] = VOCAB


def _unknown_store(extra):
    extra["ucm_connectors"][0]["ucm_connector_name"] = "UcmS3Store"


def _bad_store_value(extra):
    extra["ucm_connectors"][0]["ucm_connector_config"]["io_threads"] = 0


def _no_store(extra):
    del extra["ucm_connectors"]


def _unknown_sparse_method(extra):
    extra["ucm_sparse_config"] = {"GSA": {}}


BAD_CONFIGS = {
    "ratio_above_one": (_set_ratio, [f"ucm_sparse_config.Blend.compute_meta{LAYER_1}.ratio", "1.5"]),
    "compute_meta_not_a_layer": (_mlp_key, ["ucm_sparse_config.Blend.compute_meta", "'model.layers.1.mlp'"]),
    "check_layer_missing": (_layer_30, ["ucm_sparse_config.Blend.compute_meta", "'model.layers.30.self_attn.attn'",
                                        f"{NUM_LAYERS} layers"]),
    "chunk_end_token_outside_vocab": (_token_outside_vocab, ["ucm_sparse_config.Blend.chunk_end_token_id",
                                                             str(VOCAB), f"size {VOCAB}"]),
    "unknown_store": (_unknown_store, ["ucm_connectors[0].ucm_connector_name", "'UcmS3Store'", "UcmNfsStore"]),
    "bad_store_value": (_bad_store_value, ["ucm_connectors[0].ucm_connector_config", "io_threads"]),
    "no_store": (_no_store, ["ucm_connectors is required"]),
    "unknown_sparse_method": (_unknown_sparse_method, ["ucm_sparse_config", "'GSA'", "Blend"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_fails_naming_the_key(model_dir, tmp_path, case):
    from ucm.config import UCMConfigError

    mutate, expected = BAD_CONFIGS[case]
    extra = extra_config(tmp_path / "store")
    mutate(extra)
    config = vllm_config(model_dir, extra)
    for role in ROLES:
        with pytest.raises(UCMConfigError) as err:
            connector(config, role)
        for text in expected:
            assert text in str(err.value), (role, str(err.value))
    assert not (tmp_path / "store").exists()  # rejected before the store was opened


# ---- store directory -----------------------------------------------------------------------------


def test_store_directory_under_a_regular_file_fails_naming_it(model_dir, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where a directory should be")
    store = blocker / "store"
    config = vllm_config(model_dir, extra_config(store))
    for role in ROLES:
        with pytest.raises(ValueError) as err:
            connector(config, role)
        assert "storage_backends" in str(err.value) and repr(str(store)) in str(err.value), str(err.value)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes to read-only directories")
def test_read_only_store_directory_fails_naming_it(model_dir, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    store.chmod(0o500)
    try:
        config = vllm_config(model_dir, extra_config(store))
        with pytest.raises(ValueError) as err:
            connector(config, "SCHEDULER")
        assert "storage_backends" in str(err.value) and repr(str(store)) in str(err.value), str(err.value)
    finally:
        store.chmod(0o700)


# ---- RoPE: stored keys are shifted by rotation, which only some RoPE types allow ---------------

ROPE_THETA = 100000.0
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "rope_theta": ROPE_THETA}
SUPPORTED_ROPES = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 2048, "rope_theta": ROPE_THETA},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": ROPE_THETA},
}


def test_yarn_rope_with_blend_fails_in_the_worker(model_dir, tmp_path):
    path = copied_model(model_dir, tmp_path / "yarn", rope_parameters=YARN)
    config = vllm_config(path, extra_config(tmp_path / "store"), load_format="dummy")
    assert config.model_config.hf_text_config.rope_parameters["rope_type"] == "yarn"  # vLLM kept it
    for role in ROLES:  # both roles refuse it, before the store is opened
        with pytest.raises(ValueError) as err:
            connector(config, role)
        message = str(err.value)
        assert "rope_type='yarn'" in message and "CacheBlend" in message, message


def test_yarn_rope_without_blend_is_accepted(model_dir, tmp_path):
    path = copied_model(model_dir, tmp_path / "yarn", rope_parameters=YARN)
    config = vllm_config(path, extra_config(tmp_path / "store", blend=False), load_format="dummy")
    for role in ROLES:
        build_and_close(config, role)


@pytest.mark.parametrize("rope", sorted(SUPPORTED_ROPES))
def test_scaled_rope_that_composes_is_accepted(model_dir, tmp_path, rope):
    path = copied_model(model_dir, tmp_path / rope, rope_parameters=SUPPORTED_ROPES[rope])
    config = vllm_config(path, extra_config(tmp_path / "store"), load_format="dummy")
    assert config.model_config.hf_text_config.rope_parameters["rope_type"] == rope
    for role in ROLES:
        build_and_close(config, role)


# ---- architectures ---------------------------------------------------------------------------------


def tiny_gpt2(model_dir, dest):
    """A GPT-2 config vLLM supports (learned absolute positions, no RoPE), on the same tokenizer."""
    dest.mkdir()
    for name in MODEL_FILES[1:]:
        shutil.copy(model_dir / name, dest / name)
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 128, "n_head": 2,
              "n_layer": 2, "n_positions": 2048, "vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "float32"}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_unsupported_architecture_with_blend_fails_naming_it(model_dir, tmp_path):
    path = tiny_gpt2(model_dir, tmp_path / "gpt2")
    config = vllm_config(path, extra_config(tmp_path / "store"), load_format="dummy")
    for role in ROLES:
        with pytest.raises(ValueError) as err:
            connector(config, role)
        message = str(err.value)
        assert "GPT2LMHeadModel" in message and "ucm_sparse_config.Blend" in message, message
        assert "LlamaForCausalLM" in message  # and says what is supported


def test_unsupported_architecture_without_blend_is_accepted(model_dir, tmp_path):
    path = tiny_gpt2(model_dir, tmp_path / "gpt2")
    config = vllm_config(path, extra_config(tmp_path / "store", blend=False), load_format="dummy")
    for role in ROLES:
        c = build_and_close(config, role)
        assert c.ucm_config.sparse is None


def test_blend_with_lora_adapters_starts(model_dir, tmp_path):
    """The Blend forward maps each row it runs to its request's adapter (blend/lora_rows.py), and
    chunk keys carry the adapter: Blend and LoRA start together (tests/e2e/test_tenancy.py runs them)."""
    config = vllm_config(model_dir, extra_config(tmp_path / "store"), enable_lora=True, max_lora_rank=8)
    for role in ROLES:
        assert build_and_close(config, role).ucm_config.sparse is not None
    config = vllm_config(model_dir, extra_config(tmp_path / "store", blend=False), enable_lora=True, max_lora_rank=8)
    connector(config, "SCHEDULER")
