"""`bench.daemon.output_path` drives the daemon's output path without an engine: it must keep up
with the code it times (it reaches into the engine client's command queue and dispatch)."""

from __future__ import annotations

from bench.daemon.output_path import measure


def test_the_output_path_is_timed_for_every_token() -> None:
    """A delta a token and a stream, each through to its SSE chunk (the driver raises when
    a delta sends no chunk), both sides timed."""
    figures = measure(seqs=3, tokens=40, text="héllo wörld, 日本語 🙂 and some plain words")
    assert set(figures) == {"core_us", "event_loop_us"}
    assert all(value > 0 for value in figures.values())
