"""Other processes' work on the machine, for the tests of what a profile does under load."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def busy_neighbours(count: int = 1) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes that each keep a core busy (another user's work, as far as we can tell)."""
    spin = "import time\nend = time.time() + 600\nwhile time.time() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]
    try:
        time.sleep(0.3)  # started and spinning
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()
