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
from typing import Any

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate; raw UTF-8 text cannot hold one."""


class JSONBodyError(ValueError):
    """The text is not acceptable JSON; the message says why, for the client."""


def _refuse_constant(name: str) -> Any:
    raise JSONBodyError(f"{name} is not a JSON value")


def loads_json(raw: bytes) -> Any:
    """The decoded value of `raw`, or `JSONBodyError`."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except JSONBodyError:
        raise
    except UnicodeDecodeError as e:
        raise JSONBodyError(f"the text is not UTF-8 ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise JSONBodyError(f"{e.msg} at line {e.lineno} column {e.colno}") from e
    except RecursionError as e:
        raise JSONBodyError("it nests too deeply") from e
    except ValueError as e:  # an integer of more than 4,300 digits (sys.int_info)
        raise JSONBodyError("it holds an integer of more than 4300 digits") from e
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(value):
        raise JSONBodyError("a string holds a lone UTF-16 surrogate, which is not a character")
    return value


def _has_lone_surrogate(value: Any) -> bool:
    """True if any string (or object key) in `value` cannot be encoded as UTF-8. Iterative,
    so a deep value cannot exhaust the stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
