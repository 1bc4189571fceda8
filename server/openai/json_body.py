"""`loads_json`: decode one JSON text from a client (a request body or a batch input line).

Python's `json` accepts more than a client may send: NaN and Infinity, and lone
UTF-16 surrogates (`"\\ud800"` is not a character and cannot be written back as UTF-8);
it raises `RecursionError` on deep nesting and `ValueError` on integers of more than
4,300 digits. Every such input is refused here with one typed error, so no caller
sees anything but valid, re-encodable JSON or `JSONBodyError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate; raw UTF-8 text cannot hold one."""
_SURROGATE = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate in a decoded string (found without encoding a copy of it)."""


class JSONBodyError(ValueError):
    """The text is not acceptable JSON; the message says why, for the client."""


def _refuse_constant(name: str) -> Any:
    raise JSONBodyError(f"{name} is not a JSON value")


def decode_text(raw: bytes) -> str:
    """`raw` as text, decoded as `json.loads` decodes bytes (UTF-8, or the UTF-16/32 its
    first bytes show), or `JSONBodyError`. A caller that then drops `raw` and parses the text
    holds the text and its value at once, never the bytes as well."""
    try:
        return raw.decode(json.detect_encoding(raw), "surrogatepass")
    except UnicodeDecodeError as e:
        raise JSONBodyError(f"the text is not UTF-8 ({e.reason} at byte {e.start})") from e


def utf8_pieces(text: str, piece_chars: int = 1 << 20) -> Iterator[bytes]:
    """`text` as UTF-8 (a lone surrogate, as `decode_text` may give, as the bytes it came
    from), at most `piece_chars` characters at a time: never a whole copy of a long text."""
    for start in range(0, len(text), piece_chars):
        yield text[start : start + piece_chars].encode("utf-8", "surrogatepass")


def utf8_size(text: str) -> int:
    """The length of `text` in UTF-8 bytes, without encoding a whole copy of it."""
    return len(text) if text.isascii() else sum(len(piece) for piece in utf8_pieces(text))


def loads_json(raw: bytes | str) -> Any:
    """The decoded value of `raw` (bytes, or text from `decode_text`), or `JSONBodyError`."""
    text = raw if isinstance(raw, str) else decode_text(raw)
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except JSONBodyError:
        raise
    except json.JSONDecodeError as e:
        raise JSONBodyError(f"{e.msg} at line {e.lineno} column {e.colno}") from e
    except RecursionError as e:
        raise JSONBodyError("it nests too deeply") from e
    except ValueError as e:  # an integer of more than 4,300 digits (sys.int_info)
        raise JSONBodyError("it holds an integer of more than 4300 digits") from e
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        raise JSONBodyError("a string holds a lone UTF-16 surrogate, which is not a character")
    return value


def _has_lone_surrogate(value: Any) -> bool:
    """True if any string (or object key) in `value` cannot be encoded as UTF-8. Iterative,
    so a deep value cannot exhaust the stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
