"""Batch files without a daemon: `nanoflex run-batch` (JSONL in, JSONL out, resumable) and its
scale-out on Ray (`scale_out/`)."""
