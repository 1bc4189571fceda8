"""Where on the stack the engine asked for something: the host-wait tests name the engine's
own line that made each call (test_host_blocking.py, test_step_host_calls.py)."""

from __future__ import annotations

import inspect
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[3] / "engine"


def engine_caller() -> str | None:
    """`file:line` of the innermost engine frame on the stack (None outside the engine)."""
    for frame in inspect.stack(context=0)[2:]:
        path = Path(frame.filename).resolve()
        if path.is_relative_to(ENGINE):
            return f"{path.relative_to(ENGINE.parent)}:{frame.lineno}"
    return None
