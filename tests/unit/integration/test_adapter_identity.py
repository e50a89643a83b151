"""LoRA adapter identity by content (issue 57): the digest follows adapter_config.json and the
weight files, not the adapter's name or path, and is taken again only when the files change."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from ucm.integration.vllm.connector import adapter_identity
from ucm.integration.vllm.connector.adapter_identity import AdapterDigests, adapter_digest
from tiny_adapter import CONFIG, retrain_in_place, write_adapter


def test_retrained_in_place_changes_the_digest(tmp_path):
    path = write_adapter(tmp_path / "adapter", seed=1)
    digests = AdapterDigests()
    before = digests.digest(str(path))
    assert before == adapter_digest(str(path)) and len(before) == 32
    retrain_in_place(path, seed=2)
    assert digests.digest(str(path)) == adapter_digest(str(path)) != before


def test_the_same_files_at_two_paths_share_a_digest(tmp_path):
    path = write_adapter(tmp_path / "a" / "adapter", seed=1)
    copy = shutil.copytree(path, tmp_path / "b" / "other-name")
    (copy / "README.md").write_text("notes")  # neither config nor weights
    config = json.loads((copy / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "/elsewhere/base"  # a path: the base model is in the namespace
    (copy / "adapter_config.json").write_text(json.dumps(dict(reversed(list(config.items())))))
    assert adapter_digest(str(copy)) == adapter_digest(str(path)) == adapter_digest(str(path) + "/")
    (copy / "adapter_config.json").write_text(json.dumps({**CONFIG, "lora_alpha": 4}))
    assert adapter_digest(str(copy)) != adapter_digest(str(path))


def test_bin_weights_count_too(tmp_path):
    path = write_adapter(tmp_path / "adapter")
    before = adapter_digest(str(path))
    torch.save({"lora_A.weight": torch.zeros(2, 8)}, str(path / "new_embeddings.bin"))
    assert adapter_digest(str(path)) != before


def test_the_digest_is_taken_once_while_the_files_do_not_change(tmp_path, monkeypatch):
    path = write_adapter(tmp_path / "adapter", seed=1)
    taken = []
    digest = adapter_identity._digest
    monkeypatch.setattr(adapter_identity, "_digest", lambda local: taken.append(local) or digest(local))
    digests = AdapterDigests()
    assert len({digests.digest(str(path)) for _ in range(3)}) == 1 and len(taken) == 1
    retrain_in_place(path, seed=2)
    digests.digest(str(path))
    assert len(taken) == 2
    small = AdapterDigests(limit=1)  # the least recently used digest beyond the limit is taken again
    other = write_adapter(tmp_path / "other", seed=3)
    for p in (path, other, path):
        small.digest(str(p))
    assert len(taken) == 5


@pytest.mark.parametrize("broken", ["missing", "no_weights", "no_config", "a_file"])
def test_an_adapter_that_cannot_be_read_has_no_digest(tmp_path, broken, caplog):
    path = write_adapter(tmp_path / "adapter")
    if broken == "missing":
        shutil.rmtree(path)
    elif broken == "a_file":
        path = path / "adapter_model.safetensors"
    else:
        (path / ("adapter_model.safetensors" if broken == "no_weights" else "adapter_config.json")).unlink()
    with pytest.raises(OSError):
        adapter_digest(str(path))
    digests = AdapterDigests()
    with caplog.at_level(logging.WARNING, logger=adapter_identity.__name__):
        assert digests.digest(str(path)) is None and digests.digest(str(path)) is None
    assert len([r for r in caplog.records if "cannot be read" in r.getMessage()]) == 1  # once per path
