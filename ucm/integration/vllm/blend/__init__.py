"""Blend's forward pass inside vLLM: the model classes that hand a step to it (models), the
forward over the decoder layers (blend_forward) and the attention over scattered rows
(sparse_attention)."""
