"""Checks of inputs that every entry point shares (the command line, the HTTP server, the library): one function per
input kind, raising ValueError with one line that names the culprit, or warning with :class:`InputWarning`.

No torch, no numpy: the command line imports this before anything heavy.
"""

from __future__ import annotations

import re

__all__ = ["InputWarning", "check_text", "json_text_fields"]

_SURROGATE = re.compile("[\ud800-\udfff]")


class InputWarning(UserWarning):
    """An input that runs but probably not as meant (the command line prints it as one ``warning:`` line)."""


def check_text(text: str, what: str = "prompt") -> str:
    """``text`` if it is valid Unicode (encodable as UTF-8), else ValueError naming ``what``.

    Text that is not: a command-line argument holding bytes that are not UTF-8 (Python hands them over as lone
    surrogates U+DC80..U+DCFF, PEP 383) and JSON strings with an unpaired ``\\ud800``-style escape; tokenizers
    raise a TypeError deep inside on both."""
    if not isinstance(text, str):
        raise ValueError(f"{what}: expected text, got {type(text).__name__}")
    m = _SURROGATE.search(text)
    if m is None:
        return text
    c = ord(m.group())
    if 0xDC80 <= c <= 0xDCFF:  # surrogateescape: an undecodable byte of the original bytes
        raise ValueError(f"{what}: not valid UTF-8 (byte 0x{c - 0xDC00:02x} at character {m.start()})")
    raise ValueError(f"{what}: not valid Unicode (lone surrogate U+{c:04X} at character {m.start()})")


def json_text_fields(line: str, keys: tuple[str, ...], where: str) -> tuple[str, ...]:
    """The string fields ``keys`` of one JSONL row (``line``); ValueError naming ``where`` (``file:line``) and the
    key when the line is not a JSON object, a key is missing, or its value is not a string (a ``null`` or a number
    was scored as the text "None" / "12345") or not valid Unicode."""
    import json

    from expertcache.jsonsafe import JSONError, loads

    try:
        row = loads(line, what=where)
    except JSONError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with {', '.join(map(repr, keys))}, got a JSON "
                         f"{type(row).__name__}")
    out = []
    for key in keys:
        if key not in row:
            raise ValueError(f"{where}: no {key!r} field")
        v = row[key]
        if not isinstance(v, str):
            raise ValueError(f"{where}: {key!r} must be a string, got {json.dumps(v)[:40]}")
        out.append(check_text(v, f"{where}: {key!r}"))
    return tuple(out)

