"""Turning a model reference into tensors: checkpoints, generated (`dummy:`) weights and the
built-in demo model."""
