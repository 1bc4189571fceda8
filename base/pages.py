"""`PAGE_TOKENS`: the KV page size, the unit the engine caches and moves and the planner prices."""

PAGE_TOKENS = 16
"""Tokens per KV page (engine/core/kv_pages.py's pages; policy/prefix.py's break-even)."""
