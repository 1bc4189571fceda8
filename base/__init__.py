"""What every layer shares and nothing of ours is below: the root of input errors
(`errors.py`) and the KV page size (`pages.py`). Standard library only; no torch."""
