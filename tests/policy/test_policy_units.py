"""Byte sizes: parse_bytes and format_bytes."""

import pytest

from base.errors import UserError
from policy.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1234", 1234),
        ("16GiB", 16 * 1024**3),
        ("16GB", 16 * 10**9),
        ("16G", 16 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5TB", 1_500_000_000_000),
        (" 2 gib ", 2 * 1024**3),
        ("0", 0),
        (77, 77),
    ],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "16 gigs", "-1GB", "1.2.3", "16XB", -5])
def test_parse_bytes_rejects_bad_input(text: str | int) -> None:
    with pytest.raises(UserError, match="byte size"):
        parse_bytes(text)


def test_format_bytes() -> None:
    assert format_bytes(16 * 1024**3) == "16 GiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(12) == "12 B"
    assert format_bytes(3 * 1024**4) == "3 TiB"
    assert parse_bytes(format_bytes(512 * 1024**2).replace(" ", "")) == 512 * 1024**2
