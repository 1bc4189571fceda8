"""Byte sizes as people write them: `parse_bytes("16GiB")` and `format_bytes(17179869184)`."""

from __future__ import annotations

import re

from base.errors import UserError

# Decimal units are powers of 1000 (disk vendors, `df -H`); binary units and the
# bare letters are powers of 1024 (`free -g`, `docker --memory 16g`).
_UNIT_BYTES: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "p": 1024**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


class ByteSizeError(UserError, ValueError):
    """A byte size that cannot be read (e.g. `--gpu-mem 16 gigs`)."""


def parse_bytes(text: str | int) -> int:
    """Bytes in `text`: "1234", "512MiB", "16GB" (10^9), "16GiB" or "16G" (2^30), "1.5TB".

    Raises `ByteSizeError` for anything else, including negative sizes.
    """
    if isinstance(text, bool):
        raise ByteSizeError(f"not a byte size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ByteSizeError(f"byte size must be >= 0, got {text}")
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNIT_BYTES:
        raise ByteSizeError(f"not a byte size: {text!r} (write e.g. 1234, 512MiB, 16GB or 16GiB)")
    return round(float(match.group(1)) * _UNIT_BYTES[unit])


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: 17179869184 -> "16 GiB", 1536 -> "1.5 KiB"."""
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B" or value.is_integer():
        return f"{sign}{value:.0f} {unit}"
    return f"{sign}{value:.1f} {unit}"
