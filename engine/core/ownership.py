"""`not_writable`: why a folder the daemon must write to refuses it, naming whose it is and who
the daemon runs as.

A host folder bind-mounted into a container keeps its owner on the host (often root), while
the Docker images run the daemon as uid 1000: the plain `Permission denied` says neither, so
the error names both, and the `chown` that fixes it.
"""

from __future__ import annotations

import os
from pathlib import Path

IMAGE_UID = 1000
"""The uid the Docker images run the daemon as (docker/Dockerfile*, `USER 1000:1000`)."""


def not_writable(path: Path) -> str | None:
    """None when this process can create files in `path` (a folder, or the nearest existing
    folder above a missing one); else one sentence saying whose it is and what to do."""
    folder = path
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if os.access(folder, os.W_OK | os.X_OK):
        return None
    return ownership_hint(folder)


def ownership_hint(folder: Path) -> str:
    """Whose `folder` is and who this process is, and how to give it to this process."""
    uid, gid = os.geteuid(), os.getegid()
    try:
        stat = folder.stat()
        owner = f"belongs to uid {stat.st_uid} (mode {stat.st_mode & 0o777:o})"
    except OSError as e:
        owner = f"cannot be read ({e.strerror})"
    return (
        f"{folder} {owner} and this process runs as uid {uid}, which cannot write to it"
        f" (the nanoflex Docker images run as uid {IMAGE_UID}); for a host folder mounted"
        f" into the container: `sudo chown -R {uid}:{gid} HOST_FOLDER`"
    )
