"""The engine runtime, torch-free: what runs an engine for the daemon, `run-batch` and the Ray
replicas. `core_client.py` (the scheduler on a worker thread of this process, requests in and
deltas out over asyncio), `engine_process.py` (the executor in a child process, and the same
surface in this process), `restarts.py` (when a crashed engine process is restarted)."""
