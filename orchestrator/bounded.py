"""JSON from a host, parsed within limits: size, nesting depth and number of values are checked
before Python builds anything, so that one host's garbage fails that host's step with a clear
message instead of exhausting this machine's memory or the run record.

    data = bounded.loads(raw_bytes, what="build/test_results.json")    # BoundedJSONError (ValueError)

Invalid UTF-8 and lone surrogates (`"\\ud800"`) come out as U+FFFD; NaN and the infinities, written
as such or as a number too large for a float (`1e999`), as None (a host's number that is not finite
means nothing).

A value already parsed is cut to a short text for the record by short_text (JSON for non-strings).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_BYTES = 16 << 20
MAX_DEPTH = 32
MAX_VALUES = 500_000

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_INNERMOST = re.compile(r"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}")
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_SURROGATE = re.compile("[\ud800-\udfff]")


class BoundedJSONError(ValueError):
    """The document is not JSON, or exceeds a limit; the message says which."""


def loads(raw: bytes | str, what: str, *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH,
          max_values: int = MAX_VALUES):
    """The JSON value in `raw`, or BoundedJSONError naming `what` and the limit it broke."""
    if len(raw) > max_bytes:
        raise BoundedJSONError(f"{what} is larger than {max_bytes} bytes")
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, (bytes, bytearray)) else raw
    skeleton = _STRING.sub("0", text)           # structure only: no bracket or comma inside a string
    values = skeleton.count(",") + skeleton.count("[") + skeleton.count("{") + 1
    if values > max_values:
        raise BoundedJSONError(f"{what} holds about {values} values, more than {max_values}")
    _check_depth(_NOT_BRACKET.sub("", skeleton), what, max_depth)
    try:
        data = json.loads(text, parse_constant=lambda _: None, parse_float=_finite)
    except (ValueError, RecursionError) as e:
        raise BoundedJSONError(f"{what} is not valid JSON: {e}") from None
    return _clean(data)


def _finite(literal: str) -> float | None:
    number = float(literal)
    return number if math.isfinite(number) else None


def _check_depth(brackets: str, what: str, max_depth: int) -> None:
    """Peel the innermost pairs `max_depth` times; anything left is nested deeper."""
    for _ in range(max_depth):
        if not brackets:
            return
        brackets = _INNERMOST.sub("", brackets)
    if brackets:
        raise BoundedJSONError(f"{what} is not valid JSON or is nested deeper than {max_depth} levels")


def _clean(value):
    """Lone surrogates (from \\u escapes) as U+FFFD, in strings and keys alike."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    return value


def short_text(value: Any, limit: int) -> str:
    """``value`` as a string of at most ``limit`` characters (JSON for non-strings)."""
    if not isinstance(value, str):
        try:
            value = json.dumps(value, default=str)
        except (RecursionError, ValueError):
            value = "[unprintable]"
    return value[:limit]
