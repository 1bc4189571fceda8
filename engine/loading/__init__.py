"""Turning a model reference into tensors: checkpoints, converted GGUF files (the default
model), generated (`dummy:`) weights and the built-in demo model."""
