"""Running steps on the device: the executor, GPU batches, the block pipeline, attention,
the sampler and the hardware profiler."""
