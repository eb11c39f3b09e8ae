"""The one JSON reader: every JSON document and JSONL row expertcache reads (files and request bodies) goes
through :func:`loads`, which refuses nesting deeper than ``max_depth`` *before* parsing.

Python's ``json`` recurses once per nesting level, so a document nested thousands deep raises
``RecursionError`` (a traceback in a CLI, a 500 in the server) or, in a thread with a small stack, worse. The
depth is measured first at C speed: string literals are blanked by one regular expression, the remaining
brackets are summed as +1/-1 with ``itertools.accumulate``; the deepest prefix sum is the nesting depth.
Nothing here executes code or builds objects other than dict/list/str/int/float/bool/None.

Contract: ``loads(text)`` returns exactly what ``json.loads(text)`` returns for every document nested at most
``max_depth`` deep, and raises :class:`JSONError` (a ``ValueError``) naming ``what`` for deeper ones and for
malformed JSON.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from pathlib import Path

__all__ = ["MAX_DEPTH", "JSONError", "loads", "load_path", "depth"]

#: deepest nesting accepted by default: far beyond any config, trace header, row or request body we write
#: or accept, far below the interpreter's recursion limit
MAX_DEPTH = 64

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


class JSONError(ValueError):
    """Malformed or too deeply nested JSON; the message names the input."""


def depth(text: str | bytes) -> int:
    """How deep the brackets of ``text`` nest outside string literals (0 for a scalar)."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b'""', raw))
    if not brackets:
        return 0
    return max(0, max(accumulate(map(_STEP.__getitem__, brackets))))


def loads(text: str | bytes | bytearray, what: str = "JSON", max_depth: int = MAX_DEPTH):
    """``json.loads(text)``, refusing nesting deeper than ``max_depth`` and naming ``what`` in every error."""
    if depth(text) > max_depth:
        raise JSONError(f"{what}: JSON nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except RecursionError:  # unreachable after the depth check; kept so no caller ever sees one
        raise JSONError(f"{what}: JSON nested too deeply") from None
    except UnicodeDecodeError as e:
        raise JSONError(f"{what}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise JSONError(f"{what}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def load_path(path: str | Path, what: str | None = None, max_depth: int = MAX_DEPTH):
    """The JSON document in the file at ``path`` (see :func:`loads`); ``what`` defaults to the path."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a FIFO would block the read forever; a folder, a device: no JSON
        raise JSONError(f"{what or path}: not a regular file")
    return loads(path.read_bytes(), what=what or str(path), max_depth=max_depth)
