"""`vllm.general_plugins` entry point: runs in every vLLM process (main, engine core, worker).

Registers the UCM connector under the name "UCMConnector" and the Blend-capable model classes, and
marks vLLM's API server process (its engines inherit the mark) so the connector knows that
per-request parameters come from clients.
The model classes behave exactly like vLLM's unless the connector hands them a Blend step, so
registering them costs nothing for engines that do not use Blend. Set UCM_BLEND_NO_MODELS=1 to
skip the model registration.
"""

from __future__ import annotations

import logging
import os
import sys

CONNECTOR_NAME = "UCMConnector"
# "1" in vLLM's API server process and, inherited, in the engines it starts: per-request
# parameters come from API clients there (see ucm_sparse_config.Blend.request_params).
API_SERVER_ENV = "UCM_API_SERVER"
# vLLM architecture name -> our class, as "module:Class": vLLM imports it only where a model is
# built (the workers), so the plugin costs the other processes no model imports.
BLEND_MODELS = {
    "LlamaForCausalLM": "ucm.integration.vllm.blend.models:BlendLlamaForCausalLM",
    "MistralForCausalLM": "ucm.integration.vllm.blend.models:BlendLlamaForCausalLM",
    "Qwen2ForCausalLM": "ucm.integration.vllm.blend.models:BlendQwen2ForCausalLM",
    "Qwen3ForCausalLM": "ucm.integration.vllm.blend.models:BlendQwen3ForCausalLM",
}


# Modules only vLLM's OpenAI API server imports (0.32 launches it from `launchers`).
_API_SERVER_MODULES = ("vllm.entrypoints.launchers.api_server", "vllm.entrypoints.openai.api_server")


class _VllmHandler(logging.Handler):
    """Hands `ucm` records to vLLM's handlers (its format and stream) once vLLM has configured
    them; before that, or with vLLM's logging off, WARNING and above go where Python would send
    them without this handler (the root's handlers, else stderr)."""

    owns_level = True  # False: an application set the `ucm` level before us; it is kept

    def emit(self, record: logging.LogRecord) -> None:
        handlers = logging.getLogger("vllm").handlers
        if handlers:
            root = logging.getLogger().handlers
            for handler in handlers:  # not those the record reaches anyway, through the root
                if handler not in root and record.levelno >= handler.level:
                    handler.handle(record)
        elif not logging.getLogger().handlers and record.levelno >= logging.lastResort.level:
            logging.lastResort.handle(record)


def share_vllm_logging() -> None:
    """Log `ucm.*` in vLLM's format at vLLM's level (`--log-level`, VLLM_LOGGING_LEVEL, default INFO).

    vLLM configures only its own `vllm` logger, in each process when its engine starts: without
    this our warnings printed bare and our INFO lines (fallbacks, policy overrides) never showed.
    Called when the plugin loads and again when the connector is built (vLLM has configured its
    logging by then: `--log-level` is known); a level an application set on `ucm` is kept.
    Records still propagate to the root logger (an application's own handlers see them too).
    """
    ucm = logging.getLogger("ucm")
    handler = next((h for h in ucm.handlers if isinstance(h, _VllmHandler)), None)
    if handler is None:
        handler = _VllmHandler()
        handler.owns_level = ucm.level == logging.NOTSET
        ucm.addHandler(handler)
    if not handler.owns_level:
        return
    vllm = logging.getLogger("vllm")
    if vllm.handlers or vllm.level != logging.NOTSET:  # vLLM's logging is configured: its level
        ucm.setLevel(vllm.getEffectiveLevel())
    else:
        level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
        ucm.setLevel(level if isinstance(logging.getLevelName(level), int) else logging.INFO)


def register() -> None:
    share_vllm_logging()
    if any(m in sys.modules for m in _API_SERVER_MODULES):
        os.environ.setdefault(API_SERVER_ENV, "1")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "ucm.integration.vllm.connector.ucm_connector",
                                              "UCMConnector")
    if os.environ.get("UCM_BLEND_NO_MODELS") != "1":
        from vllm import ModelRegistry

        for arch, target in BLEND_MODELS.items():
            ModelRegistry.register_model(arch, target)
