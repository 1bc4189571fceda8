"""The engine runtime, torch-free: what runs an engine for the daemon, `run-batch` and the Ray
replicas. `step_loop_client.py` (the daemon's engine: its lifecycle, the tokenizer, requests in and
deltas out over asyncio), `engine_worker.py` (the scheduler on a worker thread, restarted
after a crash), `request_streams.py` (each request's deltas on the event loop),
`step_metrics.py` (the figures after each step), `engine_capacity.py` (the KV capacity fixed
at the first start), `model_facts.py` (the model's limits read at start), `engine_process.py`
(the executor in a child process, and the same surface in this process), `restarts.py` (when a
crashed engine process is restarted)."""
