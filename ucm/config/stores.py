"""`ucm_connectors` entries: which store, with its own config checked by the store's parser."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ucm.config.checks import UCMConfigError, _mapping, _require, _type_name, _warn_unknown


@dataclass(frozen=True)
class StoreSpec:
    """One `ucm_connectors` entry; `config` is handed unchanged to `ucm.store.create_store`."""

    name: str
    config: dict[str, Any]

    @classmethod
    def from_dict(cls, entry: Any, path: str) -> StoreSpec:
        entry = _mapping(entry, path)
        _warn_unknown(entry, {"ucm_connector_name", "ucm_connector_config"}, path)
        name = _require(entry, "ucm_connector_name", path)
        if not isinstance(name, str):
            raise UCMConfigError(f"{path}.ucm_connector_name must be a str, got {_type_name(name)}")
        config = _mapping(_require(entry, "ucm_connector_config", path), f"{path}.ucm_connector_config")
        _validate_store(name, config, path)
        return cls(name=name, config=dict(config))


def _validate_store(name: str, config: Mapping[str, Any], path: str) -> None:
    """Runs the store's own parser now, so bad store keys fail at start-up, not at first use.

    `ucm.store.factory` only exposes builders (`STORES`), not validators, so: UcmNfsStore is checked
    with `NfsStoreConfig.from_dict` (no I/O); UcmDramStore with its builder, which allocates nothing
    up front; any other registered store is only checked when it is built.
    """
    from ucm.store.config import NfsStoreConfig
    from ucm.store.factory import STORES

    if name not in STORES:
        raise UCMConfigError(
            f"{path}.ucm_connector_name: unknown store {name!r}; known stores: {', '.join(sorted(STORES))}"
        )
    validators: dict[str, Callable[[Mapping[str, Any]], Any]] = {
        "UcmNfsStore": NfsStoreConfig.from_dict,
        "UcmDramStore": STORES["UcmDramStore"],
    }
    validate = validators.get(name)
    if validate is None:
        return
    try:
        validate(config)
    except UCMConfigError:
        raise
    except ValueError as e:
        raise UCMConfigError(f"{path}.ucm_connector_config: {e}") from e

