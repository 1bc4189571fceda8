"""`ServerSettings`: the daemon's frozen configuration, built from `nanoflex serve` flags."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from base.errors import UserError
from policy.units import parse_bytes
from server.batch.data_dir import DB_NAME, FILES_DIR
from server.batch.runner import BatchConfig
from server.openai.media import NO_LOCAL_MEDIA, MediaLimits, media_limits_from

MiB = 1 << 20
API_KEY_ENV = "NANOFLEX_API_KEY"
"""Environment variable holding the API key (kept out of `ps` and the command line)."""


@dataclass(frozen=True)
class ServerSettings:
    """What the HTTP layer needs; the engine has its own config."""

    data_dir: Path
    """SQLite database `nanoflex.db` and uploaded/produced files under `files/`."""
    api_key: str | None = None
    """When set, every route but /health and /ready needs `Authorization: Bearer <api_key>`."""
    max_queue: int = 1024
    """Online sequences (prompts x n) admitted at once (waiting + running); beyond: 429."""
    max_seqs_per_request: int = 256
    """Most sequences (prompts x n) one completion or chat request may ask for; beyond: 400."""
    retry_after_s: int = 1
    """Retry-After sent with 429."""
    max_body_bytes: int = 16 * MiB
    """Largest JSON body for completions, chat and batches."""
    max_file_bytes: int = 200 * MiB
    """Largest upload to POST /v1/files (OpenAI's batch input limit)."""
    max_uploads: int = 4
    """Uploads to POST /v1/files received at once; beyond: 429. Each holds up to 1 MiB of
    memory and up to `max_file_bytes` of the data directory while it arrives."""
    max_batch_requests: int = 50_000
    """Most lines in one batch input file (OpenAI's limit)."""
    max_batches: int = 16
    """Batches unfinished at once (validating, running, finalizing); beyond: 429 on create,
    so that batches' memory and disk stay bounded."""
    max_stored_bytes: int | None = None
    """Bytes of files (uploads and batch results) the data directory may hold; an upload
    past it: 507. None: bounded by the disk alone (a full disk is 507 too)."""
    batch_concurrency: int = 64
    """Batch requests handed to the engine at once (all batches together)."""
    storage_retry_s: float = 2.0
    """How often a batch paused on a full (or read-only) data directory tries again."""
    prefix_order: bool = True
    """Hand a batch job's lines to the engine sorted by prompt (`--[no-]prefix-ordering`)."""
    ready_wait_s: float = 60.0
    """A request that arrives while the engine is not ready (loading, restarting) waits at
    most this long for it, then is answered 503 with Retry-After."""
    header_timeout_s: float = 20.0
    """A connection whose request headers have not all arrived this long after it opened (or
    after the first byte of its next request) is closed (nginx: `client_header_timeout`)."""
    body_timeout_s: float = 30.0
    """A request body that stops arriving for this long is answered 408 and closed."""
    body_total_timeout_s: float = 300.0
    """A request body (an upload included) still arriving after this long is answered 408
    and closed: a client trickling a byte now and then cannot hold a request for hours."""
    keep_alive_s: int = 5
    """An idle keep-alive connection is closed after this long (uvicorn's default)."""
    bind_host: str = "127.0.0.1"
    """The address the daemon listens on (a Host header naming it is always accepted)."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names accepted besides IP addresses, 'localhost' and `bind_host`; '*': any."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins allowed to call the API (CORS); none by default, '*': any."""
    served_model_name: str | None = None
    """Model id shown to clients; None: the engine's model name."""
    tool_call_parser: str | None = None
    """The model's tool-call format (server/openai/parsers/tool_calls.py); None: from its
    template."""
    reasoning_parser: str | None = None
    """qwen3, deepseek_r1 or none (server/openai/parsers/reasoning.py); None: from its template."""
    media_limits: MediaLimits = NO_LOCAL_MEDIA
    """What a chat may send of images (server/openai/media.py)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.max_queue < 1:
            raise UserError(f"--max-queue must be >= 1, got {self.max_queue}")
        if self.max_seqs_per_request < 1:
            raise UserError(f"max_seqs_per_request must be >= 1, got {self.max_seqs_per_request}")
        if self.max_batches < 1:
            raise UserError(f"--max-batches must be >= 1, got {self.max_batches}")
        if self.max_uploads < 1:
            raise UserError(f"--max-uploads must be >= 1, got {self.max_uploads}")
        if self.max_stored_bytes is not None and self.max_stored_bytes < 1:
            raise UserError(f"--max-stored-bytes must be > 0, got {self.max_stored_bytes}")
        if self.batch_concurrency < 1:
            raise UserError(f"batch_concurrency must be >= 1, got {self.batch_concurrency}")
        if self.ready_wait_s < 0:
            raise UserError(f"--ready-wait must be >= 0, got {self.ready_wait_s}")
        for flag, seconds in (
            ("--header-timeout", self.header_timeout_s),
            ("--body-timeout", self.body_timeout_s),
            ("--body-total-timeout", self.body_total_timeout_s),
            ("--keep-alive", self.keep_alive_s),
        ):
            if not seconds > 0:
                raise UserError(f"{flag} must be > 0 seconds, got {seconds}")
        if self.api_key is not None and not self.api_key:
            raise UserError("--api-key must not be empty; omit it to disable authentication")

    @property
    def db_path(self) -> Path:
        return self.data_dir / DB_NAME

    @property
    def files_dir(self) -> Path:
        return self.data_dir / FILES_DIR

    def batch_config(self) -> BatchConfig:
        """What the batch runner takes of these settings."""
        return BatchConfig(
            self.batch_concurrency, self.max_batch_requests, self.storage_retry_s, self.prefix_order
        )

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, environ: Mapping[str, str] = os.environ
    ) -> ServerSettings:
        """Settings from `nanoflex serve` arguments (see server/http/serve.py)."""
        return cls(
            data_dir=Path(args.data_dir),
            api_key=api_key_from(args.api_key, args.api_key_file, environ),
            max_queue=args.max_queue,
            ready_wait_s=args.ready_wait,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            body_total_timeout_s=args.body_total_timeout,
            keep_alive_s=args.keep_alive,
            max_batches=args.max_batches,
            max_uploads=args.max_uploads,
            max_stored_bytes=None
            if args.max_stored_bytes is None
            else parse_bytes(args.max_stored_bytes),
            bind_host=args.host,
            allowed_hosts=_names(args.allowed_hosts),
            allowed_origins=_names(args.allowed_origins),
            served_model_name=getattr(args, "served_model_name", None),
            tool_call_parser=getattr(args, "tool_call_parser", None),
            reasoning_parser=getattr(args, "reasoning_parser", None),
            media_limits=media_limits_from(args),
            prefix_order=getattr(args, "prefix_ordering", True),
        )


def api_key_from(flag: str | None, key_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The API key from --api-key, --api-key-file or $NANOFLEX_API_KEY (in that order of
    precedence; the flag and the file exclude each other); None: no authentication."""
    if flag is not None and key_file is not None:
        raise UserError("give the API key with --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            key = Path(key_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read the API key file {key_file}: {e}") from e
        if not key:
            raise UserError(f"the API key file {key_file} is empty")
        return key
    if flag is not None:
        return flag
    if API_KEY_ENV in environ:
        key = environ[API_KEY_ENV].strip()
        if not key:
            raise UserError(
                f"{API_KEY_ENV} is set but empty: give it the key clients must send (with "
                "docker compose: in the shell or in docker/.env), or unset it to run without one"
            )
        return key
    return None


def _names(value: str | None) -> tuple[str, ...]:
    """'a, b,c' -> ('a', 'b', 'c')."""
    return tuple(part.strip() for part in (value or "").split(",") if part.strip())
