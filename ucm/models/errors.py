class ModelPreparationError(RuntimeError):
    """A model cannot be set up (package missing, download refused, file damaged or changed)."""
