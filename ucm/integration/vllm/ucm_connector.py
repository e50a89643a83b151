"""The connector's former module path, kept so existing `kv_connector_module_path` settings work."""

from ucm.integration.vllm.connector.ucm_connector import UCMConnector

__all__ = ["UCMConnector"]
