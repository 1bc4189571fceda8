"""What /proc says of a process's threads (TESTS ONLY)."""

from __future__ import annotations

import os


def thread_nice(pid: int) -> dict[int, int]:
    """Every thread of process `pid`, and its nice value (/proc/PID/task/TID/stat: the
    19th field, the 17th after the command's closing parenthesis)."""
    nice = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = open(f"/proc/{pid}/task/{tid}/stat").read()  # noqa: SIM115 (read at once)
        nice[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])
    return nice
