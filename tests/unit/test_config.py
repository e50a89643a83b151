"""UCMConfig parsing: the UCM user format, YAML files and their precedence, errors that name the key."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest

from ucm.config import (
    SPARSE_METHODS,
    KV_SHIFT_DEFAULT,
    BlendConfig,
    StoreSpec,
    UCMConfig,
    UCMConfigError,
)

LAYER = "model.layers.1.self_attn.attn"


def example() -> dict:
    """The extra config exactly as UCM users write it."""
    return {
        "ucm_connectors": [
            {
                "ucm_connector_name": "UcmNfsStore",
                "ucm_connector_config": {"storage_backends": "/mnt/kv", "capacity_gb": 100},
            }
        ],
        "ucm_sparse_config": {"Blend": {"chunk_end_token_id": 2, "compute_meta": {LAYER: {"ratio": 0.2}}}},
    }


def parse(extra, env=None) -> UCMConfig:
    return UCMConfig.from_extra_config(extra, env={} if env is None else env)


EXAMPLE_YAML = """\
ucm_connectors:
  - ucm_connector_name: UcmNfsStore
    ucm_connector_config:
      storage_backends: /mnt/kv
      capacity_gb: 100
ucm_sparse_config:
  Blend:
    chunk_end_token_id: 2
    compute_meta:
      model.layers.1.self_attn.attn:
        ratio: 0.2
"""


@pytest.fixture
def yaml_file(tmp_path):
    path = tmp_path / "ucm.yaml"
    path.write_text(EXAMPLE_YAML)
    return path


EXPECTED_STORES = (StoreSpec("UcmNfsStore", {"storage_backends": "/mnt/kv", "capacity_gb": 100}),)
EXPECTED_BLEND = BlendConfig(chunk_end_token_id=2, check_layer_name=LAYER, check_layer=1, ratio=0.2)


# -- valid configs ---------------------------------------------------------------------------------


def test_user_example_parses_to_typed_values():
    cfg = parse(example())
    assert cfg.stores == EXPECTED_STORES
    assert cfg.sparse == EXPECTED_BLEND
    assert isinstance(cfg.sparse, BlendConfig) and cfg.sparse.name == "Blend"
    assert cfg.extra == example()
    assert cfg.config_file is None


def test_parsed_config_is_frozen_and_independent_of_the_input():
    extra = example()
    cfg = parse(extra)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sparse.ratio = 0.5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.stores = ()  # type: ignore[misc]
    extra["ucm_connectors"][0]["ucm_connector_config"]["capacity_gb"] = 1
    assert cfg.stores[0].config["capacity_gb"] == 100


def test_yaml_file_from_env_var(yaml_file):
    cfg = parse(None, env={"UCM_CONFIG_FILE": str(yaml_file)})
    assert (cfg.stores, cfg.sparse, cfg.config_file) == (EXPECTED_STORES, EXPECTED_BLEND, str(yaml_file))


def test_yaml_file_from_default_environment(yaml_file, monkeypatch):
    monkeypatch.setenv("UCM_CONFIG_FILE", str(yaml_file))
    assert UCMConfig.from_extra_config({}).sparse == EXPECTED_BLEND


def test_yaml_file_from_extra_key(yaml_file):
    cfg = parse({"UCM_CONFIG_FILE": str(yaml_file)})
    assert (cfg.stores, cfg.sparse, cfg.config_file) == (EXPECTED_STORES, EXPECTED_BLEND, str(yaml_file))
    assert "UCM_CONFIG_FILE" not in cfg.extra


def test_extra_key_file_wins_over_env_var(yaml_file, tmp_path):
    cfg = parse({"UCM_CONFIG_FILE": str(yaml_file)}, env={"UCM_CONFIG_FILE": str(tmp_path / "missing.yaml")})
    assert cfg.config_file == str(yaml_file)


def test_empty_env_var_means_no_file():
    assert parse(example(), env={"UCM_CONFIG_FILE": ""}).config_file is None


def test_inline_keys_override_file_keys_at_top_level_only(yaml_file):
    inline_sparse = {"Blend": {"compute_meta": {"model.layers.3.self_attn.attn": {"ratio": 0.5}}}}
    cfg = parse({"UCM_CONFIG_FILE": str(yaml_file), "ucm_sparse_config": inline_sparse})
    assert cfg.stores == EXPECTED_STORES  # from the file
    # The inline ucm_sparse_config replaces the file's whole section: chunk_end_token_id is gone.
    assert cfg.sparse == BlendConfig(None, "model.layers.3.self_attn.attn", 3, 0.5)
    # An inline empty section switches the file's sparse method off.
    assert parse({"UCM_CONFIG_FILE": str(yaml_file), "ucm_sparse_config": {}}).sparse is None


@pytest.mark.parametrize("ratio", [0, 1, 0.0, 1.0])
def test_ratio_bounds_are_accepted(ratio):
    extra = example()
    extra["ucm_sparse_config"]["Blend"]["compute_meta"][LAYER]["ratio"] = ratio
    sparse = parse(extra).sparse
    assert sparse.ratio == float(ratio) and isinstance(sparse.ratio, float)


@pytest.mark.parametrize("selection", ["query", "hkvd", "oracle"])
def test_selection_is_parsed_and_defaults_to_query(selection):
    assert parse(example()).sparse.selection == "query"
    extra = example()
    extra["ucm_sparse_config"]["Blend"]["compute_meta"][LAYER]["selection"] = selection
    assert parse(extra).sparse.selection == selection


@pytest.mark.parametrize("sparse", ["absent", None, {}])
def test_no_sparse_method(sparse):
    extra = example()
    if sparse == "absent":
        del extra["ucm_sparse_config"]
    else:
        extra["ucm_sparse_config"] = sparse
    assert parse(extra).sparse is None


@pytest.mark.parametrize("token", ["absent", None])
def test_chunk_end_token_id_is_optional(token):
    extra = example()
    if token == "absent":
        del extra["ucm_sparse_config"]["Blend"]["chunk_end_token_id"]
    else:
        extra["ucm_sparse_config"]["Blend"]["chunk_end_token_id"] = None
    assert parse(extra).sparse.chunk_end_token_id is None


def test_a_chunk_separator_of_token_ids_or_text():
    extra = example()
    blend = extra["ucm_sparse_config"]["Blend"]
    del blend["chunk_end_token_id"]
    blend["chunk_separator"] = [5, 6, 5]
    config = parse(extra).sparse
    assert config.chunk_end == (5, 6, 5) and config.with_separator_ids(lambda text: [9]) is config
    blend["chunk_separator"] = " # # "
    text = parse(extra).sparse
    with pytest.raises(UCMConfigError, match="not tokenized"):
        text.chunk_end
    assert text.with_separator_ids(lambda t: [7, 8]).chunk_end == (7, 8)
    with pytest.raises(UCMConfigError, match="tokenizes to no tokens"):
        text.with_separator_ids(lambda t: [])
    for bad in ([], "", [1, -2], [True], 3):
        blend["chunk_separator"] = bad
        with pytest.raises(UCMConfigError, match="chunk_separator must be"):
            parse(extra)
    blend["chunk_separator"], blend["chunk_end_token_id"] = [5, 6], 2
    with pytest.raises(UCMConfigError, match="not both"):
        parse(extra)
    blend["chunk_end_token_id"] = None
    with pytest.raises(UCMConfigError, match="outside the model's vocabulary"):
        parse(extra).sparse.validate_for_model(30, 6)


@pytest.mark.parametrize("policy, setting, on", [("any", None, False), ("alone", None, True),
                                                 ("alone", False, False), ("any", True, True)])
def test_missed_chunks_are_computed_alone_by_default_only_under_the_alone_policy(policy, setting, on):
    extra = example()
    extra["ucm_sparse_config"]["Blend"]["chunk_store"] = policy
    if setting is not None:
        extra["ucm_sparse_config"]["Blend"]["background_chunks"] = setting
    assert parse(extra).sparse.computes_missed_chunks_alone is on


def test_admission_defaults_to_adaptive_and_names_a_wrong_policy():
    assert parse(example()).sparse.admission == "adaptive"
    extra = example()
    extra["ucm_sparse_config"]["Blend"]["admission"] = "first_sighting"
    assert parse(extra).sparse.admission == "first_sighting"
    extra["ucm_sparse_config"]["Blend"]["admission"] = "always"
    with pytest.raises(UCMConfigError, match=r"ucm_sparse_config\.Blend\.admission must be one of"):
        parse(extra)


def test_several_stores_and_dram_store():
    extra = example()
    extra["ucm_connectors"].insert(
        0, {"ucm_connector_name": "UcmDramStore", "ucm_connector_config": {"capacity_gb": 0.5}}
    )
    assert [s.name for s in parse(extra).stores] == ["UcmDramStore", "UcmNfsStore"]


def test_sparse_registry_accepts_new_methods(monkeypatch):
    monkeypatch.setitem(SPARSE_METHODS, "Other", lambda d, path: ("other", path, d))
    extra = example()
    extra["ucm_sparse_config"] = {"Other": {"k": 1}}
    assert parse(extra).sparse == ("other", "ucm_sparse_config.Other", {"k": 1})


# -- errors name the key ---------------------------------------------------------------------------


def _set(path, value):
    """Mutator setting (or, with value=DELETE, removing) example()[path...]."""

    def mutate(extra):
        *parents, last = path
        d = extra
        for p in parents:
            d = d[p]
        if value is DELETE:
            del d[last]
        else:
            d[last] = value

    return mutate


DELETE = object()
STORE0 = ("ucm_connectors", 0)
BLEND = ("ucm_sparse_config", "Blend")
META = (*BLEND, "compute_meta")
RATIO = (*META, LAYER, "ratio")
TOKEN_MSG = "ucm_sparse_config.Blend.chunk_end_token_id must be a non-negative int"
META_MSG = "ucm_sparse_config.Blend.compute_meta"
EXAMPLE_META = '{"model.layers.1.self_attn.attn": {"ratio": 0.2}}'
RATIO_PATH = 'ucm_sparse_config.Blend.compute_meta["model.layers.1.self_attn.attn"].ratio'

ERROR_CASES = [
    (_set(("ucm_connectors",), DELETE), "ucm_connectors is required"),
    (_set(("ucm_connectors",), {"a": 1}), "ucm_connectors must be a list, got dict"),
    (_set(("ucm_connectors",), []), "ucm_connectors must list at least one store"),
    (_set(STORE0, "UcmNfsStore"), "ucm_connectors[0] must be a mapping, got str"),
    (_set((*STORE0, "ucm_connector_name"), DELETE), "ucm_connectors[0].ucm_connector_name is required"),
    (_set((*STORE0, "ucm_connector_name"), 3), "ucm_connectors[0].ucm_connector_name must be a str, got int"),
    (
        _set((*STORE0, "ucm_connector_name"), "NfsStore"),
        "ucm_connectors[0].ucm_connector_name: unknown store 'NfsStore'; known stores: UcmDramStore, UcmNfsStore",
    ),
    (_set((*STORE0, "ucm_connector_config"), DELETE), "ucm_connectors[0].ucm_connector_config is required"),
    (
        _set((*STORE0, "ucm_connector_config"), "/mnt/kv"),
        "ucm_connectors[0].ucm_connector_config must be a mapping, got str",
    ),
    (
        _set((*STORE0, "ucm_connector_config", "storage_backends"), DELETE),
        "ucm_connectors[0].ucm_connector_config: storage_backends is required",
    ),
    (
        _set((*STORE0, "ucm_connector_config", "io_threads"), 0),
        "ucm_connectors[0].ucm_connector_config: io_threads must be an integer",
    ),
    (
        _set(("ucm_connectors", 1), {"ucm_connector_name": "UcmDramStore", "ucm_connector_config": {}}),
        "ucm_connectors[1].ucm_connector_config: capacity_gb must be a number > 0",
    ),
    (_set(("ucm_sparse_config",), ["Blend"]), "ucm_sparse_config must be a mapping, got list"),
    (
        _set(("ucm_sparse_config", "Other"), {}),
        "ucm_sparse_config must name at most one sparse method, got 2: Blend, Other",
    ),
    (
        _set(("ucm_sparse_config",), {"CacheBlend": {}}),
        "ucm_sparse_config: unknown sparse method 'CacheBlend'; known methods: Blend",
    ),
    (_set(BLEND, None), "ucm_sparse_config.Blend must be a mapping, got NoneType"),
    (_set((*BLEND, "chunk_end_token_id"), -1), f"{TOKEN_MSG} (or absent), got -1 (int)"),
    (_set((*BLEND, "chunk_end_token_id"), "2"), f"{TOKEN_MSG} (or absent), got '2' (str)"),
    (_set((*BLEND, "chunk_end_token_id"), 2.0), f"{TOKEN_MSG} (or absent), got 2.0 (float)"),
    (_set((*BLEND, "chunk_end_token_id"), True), f"{TOKEN_MSG} (or absent), got True (bool)"),
    (_set(META, DELETE), f"{META_MSG} is required"),
    (_set(META, [LAYER]), f"{META_MSG} must be a mapping, got list"),
    (_set(META, {}), f"{META_MSG} must name at least one check layer, e.g. {EXAMPLE_META}"),
    (_set((*META, "model.layers.2.self_attn.attn"), {"ratio": 0.5}),
     f'{META_MSG}["model.layers.2.self_attn.attn"].ratio 0.5 is above the ratio of the check layer before it'),
    (_set((*META, "model.layers.2.self_attn.attn"), {"ratio": 0.1, "selection": "hkvd"}),
     f'{META_MSG}["model.layers.2.self_attn.attn"]: selection belong(s) to the first check layer only'),
    (_set((*META, "model.layers.2.self_attn.attn"), {}),
     f'{META_MSG}["model.layers.2.self_attn.attn"].ratio is required'),
    (
        _set(META, {"1": {"ratio": 0.2}}),
        f"{META_MSG} key '1' is not an attention layer name; "
        f"expected model.layers.<i>.self_attn.attn, e.g. {EXAMPLE_META}",
    ),
    (_set(META, {1: {"ratio": 0.2}}), f"{META_MSG} key 1 is not an attention layer name"),
    (_set(META, {"model.layers.01.self_attn.attn": {"ratio": 0.2}}), "key 'model.layers.01.self_attn.attn' is not"),
    (_set(META, {"model.layers.1.mlp": {"ratio": 0.2}}), "key 'model.layers.1.mlp' is not"),
    (_set(META, {"layers.1.self_attn.attn": {"ratio": 0.2}}), "key 'layers.1.self_attn.attn' is not"),
    (_set((*META, LAYER), 0.2), f'{META_MSG}["{LAYER}"] must be a mapping, got float'),
    (_set(RATIO, DELETE), f"{RATIO_PATH} is required"),
    (_set(RATIO, 1.5), f"{RATIO_PATH} must be a number in [0, 1], got 1.5"),
    (_set(RATIO, -0.1), f"{RATIO_PATH} must be a number in [0, 1], got -0.1"),
    (_set(RATIO, "0.2"), f"{RATIO_PATH} must be a number in [0, 1], got '0.2'"),
    (_set(RATIO, True), f"{RATIO_PATH} must be a number in [0, 1], got True"),
    (_set(RATIO, float("nan")), f"{RATIO_PATH} must be a number in [0, 1], got nan"),
    (_set((*BLEND, "min_hit_share"), 1.2), "ucm_sparse_config.Blend.min_hit_share must be a number in [0, 1], got 1.2"),
    (_set((*BLEND, "min_hit_share"), "x"), "ucm_sparse_config.Blend.min_hit_share must be a number in [0, 1], got 'x'"),
    (_set((*BLEND, "chunk_refs"), "yes"), "ucm_sparse_config.Blend.chunk_refs must be true or false (or absent), got 'yes'"),
    (
        _set((*BLEND, "background_chunks"), 1),
        "ucm_sparse_config.Blend.background_chunks must be true or false (or absent), got 1",
    ),
    (
        _set((*META, LAYER, "selection"), "attention"),
        f"{RATIO_PATH[:-len('ratio')]}selection must be one of 'query', 'hkvd', 'oracle', 'key_l1', 'key_l2', 'chunk_start', got 'attention'",
    ),
]


@pytest.mark.parametrize("mutate, message", ERROR_CASES)
def test_errors_name_the_key(mutate, message):
    extra = example()
    if "ucm_connectors[1]" in message:
        extra["ucm_connectors"].append(None)
    mutate(extra)
    with pytest.raises(UCMConfigError, match=re.escape(message)):
        parse(extra)


def test_error_is_a_value_error():
    assert issubclass(UCMConfigError, ValueError)


def test_extra_not_a_mapping():
    with pytest.raises(UCMConfigError, match="kv_connector_extra_config must be a mapping, got list"):
        parse([example()])


def test_nothing_configured_names_the_required_key():
    with pytest.raises(UCMConfigError, match="ucm_connectors is required"):
        parse(None)


def test_old_single_store_form_gets_a_hint():
    with pytest.raises(UCMConfigError, match="ucm_connectors is required.*one-element list"):
        parse({"ucm_connector_name": "UcmNfsStore", "ucm_connector_config": {"storage_backends": "/mnt/kv"}})


def test_config_file_key_of_wrong_type():
    expected = "kv_connector_extra_config.UCM_CONFIG_FILE must be a path string, got int"
    with pytest.raises(UCMConfigError, match=re.escape(expected)):
        parse({"UCM_CONFIG_FILE": 3})


# -- YAML file errors name the file ----------------------------------------------------------------


def _file_error(tmp_path, content: bytes | None, message: str, via_env: bool):
    path = tmp_path / "bad.yaml"
    if content is None:
        pass  # missing
    elif content == b"<dir>":
        path.mkdir()
    else:
        path.write_bytes(content)
    source = "environment variable UCM_CONFIG_FILE" if via_env else "kv_connector_extra_config.UCM_CONFIG_FILE"
    expected = f"UCM_CONFIG_FILE file {str(path)!r} (from {source}) {message}"
    extra, env = ({}, {"UCM_CONFIG_FILE": str(path)}) if via_env else ({"UCM_CONFIG_FILE": str(path)}, {})
    with pytest.raises(UCMConfigError, match=re.escape(expected)):
        parse(extra, env)


@pytest.mark.parametrize("via_env", [True, False])
@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        (b"<dir>", "cannot be read"),
        (b"\xff\xfe\x00bad", "cannot be read"),
        (b"ucm_connectors: [unclosed\n", "is not valid YAML"),
        (b"- ucm_connectors\n", "must hold a mapping at top level, got list"),
        (b"just a string\n", "must hold a mapping at top level, got str"),
        (b"", "must hold a mapping at top level, got an empty file"),
    ],
)
def test_bad_yaml_file_names_the_file(tmp_path, content, message, via_env):
    _file_error(tmp_path, content, message, via_env)


def test_error_inside_the_file_names_the_key(tmp_path):
    path = tmp_path / "ucm.yaml"
    path.write_text(EXAMPLE_YAML.replace("ratio: 0.2", "ratio: 1.5"))
    with pytest.raises(UCMConfigError, match=re.escape(f"{RATIO_PATH} must be a number in [0, 1], got 1.5")):
        parse(None, env={"UCM_CONFIG_FILE": str(path)})


# -- unknown keys warn; typos of known keys fail -----------------------------------------------------


@pytest.mark.parametrize(
    "path, expected",
    [
        (("ucm_sparse_settings",), "kv_connector_extra_config: unknown keys ignored: ucm_sparse_settings"),
        ((*STORE0, "ucm_connector_cfg"), "ucm_connectors[0]: unknown keys ignored: ucm_connector_cfg"),
        ((*BLEND, "chunk_end_token"), "ucm_sparse_config.Blend: unknown keys ignored: chunk_end_token"),
        ((*META, LAYER, "ratio_of_tokens"), f'{META_MSG}["{LAYER}"]: unknown keys ignored: ratio_of_tokens'),
    ],
)
def test_unknown_keys_warn(caplog, path, expected):
    extra = example()
    _set(path, 1)(extra)
    with caplog.at_level(logging.WARNING, logger="ucm.config"):
        cfg = parse(extra)
    assert cfg.sparse == EXPECTED_BLEND
    assert expected in caplog.text


@pytest.mark.parametrize(
    "path, typo, meant",
    [
        ((), "ucm_sparse_conf", "ucm_sparse_config"),
        ((*BLEND,), "max_step_token", "max_step_tokens"),
        ((*META, LAYER), "ratios", "ratio"),
        ((*STORE0, "ucm_connector_config"), "capacty_gb", "capacity_gb"),
    ],
)
def test_a_typo_of_a_known_key_fails_naming_the_key(path, typo, meant):
    extra = example()
    _set((*path, typo), 1)(extra)
    with pytest.raises(UCMConfigError, match=f"unknown key '{typo}'; did you mean '{meant}'"):
        parse(extra)


def test_unknown_store_key_warns_via_the_store_parser(caplog):
    extra = example()
    extra["ucm_connectors"][0]["ucm_connector_config"]["prefetch_depth"] = 8
    with caplog.at_level(logging.WARNING):
        parse(extra)
    assert caplog.text.count("prefetch_depth") == 1, "warned once, through the log"


def test_ucm_top_level_keys_are_accepted_without_effect(caplog):
    extra = example()
    extra.update(load_only_first_rank=False, metrics_config_path="/tmp/metrics.yaml")
    with caplog.at_level(logging.INFO, logger="ucm.config"):
        parse(extra)
    assert "unknown" not in caplog.text
    assert caplog.text.count("has no effect here") == 2


def test_use_layerwise_is_a_switch_on_by_default():
    assert parse(example()).use_layerwise is True
    assert parse({**example(), "use_layerwise": False}).use_layerwise is False
    with pytest.raises(UCMConfigError, match="use_layerwise must be true or false"):
        parse({**example(), "use_layerwise": "yes"})


def test_ucm_schema_store_keys_are_accepted_without_effect(caplog):
    extra = example()
    extra["ucm_connectors"][0]["ucm_connector_config"].update(kv_block_size=33554432, use_layerwise=False)
    with caplog.at_level(logging.INFO):
        parse(extra)
    assert "no effect" in caplog.text


def test_known_keys_do_not_warn(caplog, yaml_file):
    with caplog.at_level(logging.WARNING):
        parse(example())
        parse({"UCM_CONFIG_FILE": str(yaml_file)})
    assert caplog.text == ""


def test_nested_config_file_key_in_file_warns(caplog, tmp_path):
    path = tmp_path / "ucm.yaml"
    path.write_text(EXAMPLE_YAML + "UCM_CONFIG_FILE: /other.yaml\n")
    with caplog.at_level(logging.WARNING, logger="ucm.config"):
        cfg = parse(None, env={"UCM_CONFIG_FILE": str(path)})
    assert cfg.config_file == str(path)
    assert "nested config files are not followed" in caplog.text


# -- validate_for_model ----------------------------------------------------------------------------


def test_validate_for_model_accepts_a_fitting_model(caplog):
    with caplog.at_level(logging.WARNING, logger="ucm.config"):
        EXPECTED_BLEND.validate_for_model(num_layers=30, vocab_size=49152)
        EXPECTED_BLEND.validate_for_model(num_layers=2, vocab_size=3)  # layer 1 is the last: warns
        BlendConfig(None, "model.layers.0.self_attn.attn", 0, 0.2).validate_for_model(num_layers=1, vocab_size=1)
    # A check at the last layer (2nd and 3rd calls) is allowed, but warned about.
    assert caplog.text.count("saves no compute") == 2


@pytest.mark.parametrize("num_layers", [0, 1])
def test_validate_for_model_rejects_a_missing_check_layer(num_layers):
    expected = (
        f"ucm_sparse_config.Blend.compute_meta: check layer '{LAYER}' does not exist; "
        f"the model has {num_layers} layers"
    )
    with pytest.raises(UCMConfigError, match=re.escape(expected)):
        EXPECTED_BLEND.validate_for_model(num_layers=num_layers, vocab_size=100)


@pytest.mark.parametrize("vocab_size", [1, 2])
def test_validate_for_model_rejects_a_token_outside_the_vocabulary(vocab_size):
    expected = f"ucm_sparse_config.Blend.chunk_end_token_id 2 is outside the model's vocabulary (size {vocab_size})"
    with pytest.raises(UCMConfigError, match=re.escape(expected)):
        EXPECTED_BLEND.validate_for_model(num_layers=30, vocab_size=vocab_size)
    # Without a marker token, any vocabulary fits.
    dataclasses.replace(EXPECTED_BLEND, chunk_end_token_id=None).validate_for_model(30, vocab_size)


def test_direct_construction_checks_layer_name_and_index_agree():
    with pytest.raises(UCMConfigError, match="does not match check_layer 2"):
        BlendConfig(2, LAYER, 2, 0.2)


def test_chunk_start_tokens_is_positive_for_epic_and_non_negative_for_ranked_rules():
    from ucm.config import BlendConfig, UCMConfigError

    layer = "model.layers.1.self_attn.attn"

    def config(**meta):
        return BlendConfig.from_dict({"chunk_end_token_id": 2, "compute_meta": {layer: {"ratio": 0.1, **meta}}})

    assert (config(selection="chunk_start", chunk_start_tokens=8).chunk_start_tokens) == 8
    assert config(chunk_start_tokens=0).chunk_start_tokens == 0  # "query": no chunk starts first
    assert config(chunk_start_tokens=16).chunk_start_tokens == 16  # "query" + EPIC's rows
    assert config().chunk_start_tokens is None  # the rule's default
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(UCMConfigError, match=r"chunk_start_tokens must be an int >= 0"):
            config(chunk_start_tokens=bad)
    with pytest.raises(UCMConfigError, match=r"chunk_start_tokens must be a positive int with selection 'chunk_start'"):
        config(selection="chunk_start", chunk_start_tokens=0)


def test_chunk_start_tokens_default_per_rule():
    from ucm.sparse.blend.vocabulary import DEFAULT_CHUNK_START_TOKENS, Selection, chunk_start_tokens_for

    assert chunk_start_tokens_for(Selection.CHUNK_START, None) == DEFAULT_CHUNK_START_TOKENS
    assert chunk_start_tokens_for(Selection.CHUNK_START, 8) == 8
    assert chunk_start_tokens_for(Selection.QUERY, None) == 0
    assert chunk_start_tokens_for(Selection.HKVD, 16) == 16

def test_kv_shift_is_a_share():
    from ucm.config import BlendConfig, UCMConfigError

    layer = "model.layers.1.self_attn.attn"

    def config(**meta):
        return BlendConfig.from_dict({"chunk_end_token_id": 2, "compute_meta": {layer: {"ratio": 0.1, **meta}}})

    assert config().kv_shift == KV_SHIFT_DEFAULT == 0.5 and config(kv_shift=True).kv_shift == 1.0
    assert config(kv_shift=False).kv_shift == 0.0 and config(kv_shift=0.5).kv_shift == 0.5
    assert config(kv_shift=1).kv_shift == 1.0
    for bad in (1.5, -0.1, "true", None, float("nan")):
        with pytest.raises(UCMConfigError, match=r"kv_shift must be a number in \[0, 1\] \(or true / false\)"):
            config(kv_shift=bad)


def test_kv_shift_sample_is_a_share_up_to_a_half():
    from ucm.config import BlendConfig, UCMConfigError

    layer = "model.layers.1.self_attn.attn"

    def config(**meta):
        return BlendConfig.from_dict({"chunk_end_token_id": 2, "compute_meta": {layer: {"ratio": 0.15, **meta}}})

    assert config().kv_shift_sample == 0.0 and config(kv_shift_sample=0.03).kv_shift_sample == 0.03
    for bad in (0.6, -0.1, True, "0.03", None):
        with pytest.raises(UCMConfigError, match=r"kv_shift_sample must be a number in \[0, 0.5\]"):
            config(kv_shift_sample=bad)


def test_several_check_layers_narrow_with_depth():
    """CacheBlend's gradual filtering: the shallowest layer is the check layer (with every key),
    the deeper ones give the ratio the selection narrows to there, in layer order."""
    from ucm.config import BlendConfig

    blend = BlendConfig.from_dict({"chunk_end_token_id": 2, "compute_meta": {
        "model.layers.8.self_attn.attn": {"ratio": 0.1},
        "model.layers.1.self_attn.attn": {"ratio": 0.3, "selection": "hkvd"},
        "model.layers.4.self_attn.attn": {"ratio": 0.2}}})
    assert blend.check_layer == 1 and blend.ratio == 0.3 and blend.selection == "hkvd"
    assert blend.later_checks == ((4, 0.2), (8, 0.1))
    with pytest.raises(UCMConfigError, match="check layer 'model.layers.40.self_attn.attn' does not exist"):
        BlendConfig.from_dict({"chunk_end_token_id": 2, "compute_meta": {
            "model.layers.1.self_attn.attn": {"ratio": 0.3},
            "model.layers.40.self_attn.attn": {"ratio": 0.1}}}).validate_for_model(30, 1000)


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_async_prefix_loads_takes_true_false_or_auto(value):
    assert parse({**example(), "async_prefix_loads": value}).async_prefix_loads == value
    assert parse(example()).async_prefix_loads == "auto"


@pytest.mark.parametrize("value", ["yes", 1, None, "Auto"])
def test_async_prefix_loads_names_a_bad_value(value):
    with pytest.raises(UCMConfigError, match="async_prefix_loads must be true, false or \"auto\""):
        parse({**example(), "async_prefix_loads": value})
