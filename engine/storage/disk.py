"""The disk tier: real files in the offload directory, read and written by a pool of copy threads.

Page cache: after a file is written, and after each read, we ask the kernel to drop
its cached pages (posix_fadvise DONTNEED), so that the next read comes from the
device rather than from memory the cpu tier would otherwise be charged for. This
is best effort (the kernel may keep pages it is writing back); O_DIRECT is not
used because it needs aligned buffers and would rule out tmpfs offload dirs.

Faults: a read or write that fails for a reason outside the engine (a full disk, a quota, an
I/O error, a file cut short) raises `OffloadIOError`, which the executor turns into a storage
fault of the step (the step's sequences are recomputed, the disk tier rests a while), never
a crash of the engine.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

_CHUNK_BYTES = 8 << 20  # split large reads and writes so several copy threads share them
_FADVISE = hasattr(os, "posix_fadvise")


FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
STORAGE_ERRNOS = FULL_ERRNOS | {errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT}
"""OS errors of the offload directory that say "this I/O cannot happen now", not a bug."""


class OffloadIOError(OSError):
    """A read or write of the offload directory failed (disk full, I/O error, a file cut
    short). `pages`: the disk KV pages a failed read covered (their cached copies are
    suspect), filled in by the KV pool."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(code or errno.EIO, message)
        self.message = message
        self.pages: list[int] = []

    def __str__(self) -> str:
        return self.message

    @property
    def is_full(self) -> bool:
        return self.errno in FULL_ERRNOS


def offload_error(e: OSError, what: str) -> OffloadIOError | None:
    """`e` as an `OffloadIOError` while doing `what` ("writing kv-0003.bin"), None when it
    is not a storage fault."""
    if isinstance(e, OffloadIOError):
        return e
    if e.errno not in STORAGE_ERRNOS:
        return None
    reason = e.strerror or errno.errorcode.get(e.errno or 0, "an OS error")
    return OffloadIOError(f"{what} failed: {reason}", e.errno)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor."""
    return t.contiguous().view(-1).view(torch.uint8)


class DiskFile:
    """One file read and written at byte offsets (pread/pwrite: safe from many threads)."""

    def __init__(self, path: Path, keep: bool = False) -> None:
        self.path, self.keep = path, keep
        """keep: an existing file is opened as it is and outlives the process (the disk KV
        cache); otherwise the file starts empty and is removed at close."""
        flags = os.O_RDWR | os.O_CREAT | (0 if keep else os.O_TRUNC)
        self.fd = os.open(path, flags, 0o600)

    def write(self, offset: int, data: torch.Tensor) -> None:
        view = as_bytes(data).numpy().data
        while view:
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        view = as_bytes(out).numpy().data
        while view:
            got = os.preadv(self.fd, [view], offset)
            if got == 0:  # the file was cut short: damage, as an I/O error is
                raise OffloadIOError(
                    f"reading {self.path.name} failed: the file ends before offset {offset}",
                    errno.EIO,
                )
            view, offset = view[got:], offset + got

    def drop_cache(self, offset: int = 0, length: int = 0) -> None:
        """Ask the kernel to drop the cached pages of [offset, offset + length) (0: to the
        end of the file)."""
        if _FADVISE:
            os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        os.close(self.fd)


class DiskIO:
    """The copy-thread pool for disk transfers. Leaf tasks only: they never wait on other tasks,
    so callers on any thread may block on them without deadlock."""

    def __init__(self, root: Path, num_threads: int) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="nanoflex-disk")
        self._files: list[DiskFile] = []

    def open(self, name: str, keep: bool = False) -> DiskFile:
        try:
            f = DiskFile(self.root / name, keep)
        except OSError as e:
            raise _translated(e, f"opening {name} in {self.root}") from e
        self._files.append(f)
        return f

    def read(self, f: DiskFile, offset: int, out: torch.Tensor) -> None:
        """Fill `out` from f[offset:], in parallel chunks; returns when all bytes arrived. The
        range read is dropped from the page cache (only that range: cheap for small reads).
        Raises `OffloadIOError` when the bytes cannot be read."""
        data = as_bytes(out)
        try:
            self._run_chunked(f.read_into, offset, data)
            f.drop_cache(offset, data.numel())
        except OSError as e:
            raise _translated(e, f"reading {f.path.name} in {self.root}") from e

    def write(self, f: DiskFile, offset: int, data: torch.Tensor) -> None:
        """Write `data` at f[offset:]; raises `OffloadIOError` when the disk refuses it."""
        try:
            self._run_chunked(f.write, offset, as_bytes(data))
        except OSError as e:
            raise _translated(e, f"writing {f.path.name} in {self.root}") from e

    def _run_chunked(
        self, op: Callable[[int, torch.Tensor], None], offset: int, buf: torch.Tensor
    ) -> None:
        n = buf.numel()
        if n <= _CHUNK_BYTES:
            op(offset, buf)
            return
        futures: list[Future[None]] = [
            self._pool.submit(op, offset + start, buf[start : start + _CHUNK_BYTES])
            for start in range(0, n, _CHUNK_BYTES)
        ]
        for fut in futures:
            fut.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for f in self._files:
            f.close()
            if not f.keep:
                f.path.unlink(missing_ok=True)
        self._files.clear()


def _translated(e: OSError, what: str) -> OSError:
    return offload_error(e, what) or e
