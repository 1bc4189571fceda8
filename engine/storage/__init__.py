"""Where bytes live and how they move: the compute device and its streams, disk files,
the paged KV store, the weight store and 4-bit quantization."""
