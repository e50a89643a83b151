"""Models the project can run without downloading anything (see `python -m ucm.models`)."""

from ucm.models.smollm2 import ModelPreparationError, default_model_dir, prepare

__all__ = ["ModelPreparationError", "default_model_dir", "prepare"]
