"""Text held back in a stream because it may begin a marker (a reasoning parser's, a tool
call's)."""

from __future__ import annotations


def partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
