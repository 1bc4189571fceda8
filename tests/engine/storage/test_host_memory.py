"""The engine keeps large freed blocks in malloc's heap (glibc), and the switch turns it off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import ctypes, ctypes.util
from engine.storage.host_memory import keep_freed_memory

FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in FIELDS.split()]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.mallinfo2.restype = MallInfo2
took = keep_freed_memory()
block = libc.malloc(96 << 20)  # a 1.1B model's float32 MLP output of a 2048-token step
mapped = libc.mallinfo2().hblkhd
libc.free(ctypes.c_void_p(block))
print(took, mapped >= 96 << 20, libc.mallinfo2().fordblks >= 96 << 20)
"""


def probe(switch: str) -> str:
    env = {**os.environ, "NANOFLEX_KEEP_FREED_MEMORY": switch}
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_freed_blocks_stay_in_the_heap_unless_switched_off() -> None:
    # kept: served from the heap (not its own mapping) and still there, free, after free()
    assert probe("1") == ["True", "False", "True"]
    # glibc's default: a block over 32 MiB is its own mapping, unmapped when freed
    assert probe("0") == ["False", "True", "False"]
