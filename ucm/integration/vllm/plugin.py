"""`vllm.general_plugins` entry point: runs in every vLLM process (main, engine core, worker).

Registers the UCM connector under the name "UCMConnector" and the Blend-capable model classes.
The model classes behave exactly like vLLM's unless the connector hands them a Blend step, so
registering them costs nothing for engines that do not use Blend. Set UCM_BLEND_NO_MODELS=1 to
skip the model registration.
"""

from __future__ import annotations

import os

CONNECTOR_NAME = "UCMConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "ucm.integration.vllm.ucm_connector", "UCMConnector")
    if os.environ.get("UCM_BLEND_NO_MODELS") != "1":
        from vllm import ModelRegistry

        from ucm.integration.vllm.models import OVERRIDES

        for arch, target in OVERRIDES.items():
            ModelRegistry.register_model(arch, target)
