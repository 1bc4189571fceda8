"""The torch-free half of the engine: what the daemon process may import.

Requests, sampling parameters, sequences and outputs; the scheduler and its KV page
bookkeeping; the step protocol between scheduler and executor; the engine loop;
finding a model and reading its torch-free facts; the tokenizer; policy resolution.
Nothing under this package imports torch or numpy (tests/engine/core/test_torch_free.py).
"""
