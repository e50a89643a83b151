"""docs/configuration.md lists every key the config code accepts, and the README stays short."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from ucm.config import BLEND_KEYS, LAYER_META_KEYS, REQUEST_PARAMS
from ucm.store.config import NfsStoreConfig

REPO = Path(__file__).resolve().parents[2]


def test_every_key_is_documented():
    page = (REPO / "docs" / "configuration.md").read_text()
    missing = [f"Blend.{k}" for k in sorted(BLEND_KEYS) if f"`ucm_sparse_config.Blend.{k}`" not in page]
    missing += [f"compute_meta[layer].{k}" for k in sorted(LAYER_META_KEYS)
                if f"`compute_meta[layer].{k}`" not in page and k != "ratio"]
    missing += [f"ucm_connector_config.{f.name}" for f in fields(NfsStoreConfig)
                if f"`ucm_connector_config.{f.name}`" not in page]
    missing += [p for p in REQUEST_PARAMS if f'"{p}"' not in page]
    assert not missing, f"docs/configuration.md does not describe: {', '.join(missing)}"


def test_readme_is_short():
    size = len((REPO / "README.md").read_bytes())
    assert size < 14 * 1024, f"README.md is {size} bytes: move reference material to docs/"
