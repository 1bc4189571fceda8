"""`ServerSettings`: the daemon's frozen configuration, built from `nanoflex serve` flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from policy.errors import UserError

MiB = 1 << 20


@dataclass(frozen=True)
class ServerSettings:
    """What the HTTP layer needs; the engine has its own config."""

    data_dir: Path
    """SQLite database `nanoflex.db` and uploaded/produced files under `files/`."""
    api_key: str | None = None
    """When set, every /v1 route needs `Authorization: Bearer <api_key>`."""
    max_queue: int = 1024
    """Online requests admitted at once (waiting + running); beyond it: 429."""
    retry_after_s: int = 1
    """Retry-After sent with 429."""
    max_body_bytes: int = 16 * MiB
    """Largest JSON body for completions, chat and batches."""
    max_file_bytes: int = 200 * MiB
    """Largest upload to POST /v1/files (OpenAI's batch input limit)."""
    max_batch_requests: int = 50_000
    """Most lines in one batch input file (OpenAI's limit)."""
    batch_concurrency: int = 64
    """Batch requests handed to the engine at once (all batches together)."""
    served_model_name: str | None = None
    """Model id shown to clients; None: the engine's model name."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.max_queue < 1:
            raise UserError(f"--max-queue must be >= 1, got {self.max_queue}")
        if self.batch_concurrency < 1:
            raise UserError(f"batch_concurrency must be >= 1, got {self.batch_concurrency}")
        if self.api_key is not None and not self.api_key:
            raise UserError("--api-key must not be empty; omit it to disable authentication")

    @property
    def db_path(self) -> Path:
        return self.data_dir / "nanoflex.db"

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        """Settings from `nanoflex serve` arguments (see server/cli.py)."""
        return cls(
            data_dir=Path(args.data_dir),
            api_key=args.api_key,
            max_queue=args.max_queue,
        )
