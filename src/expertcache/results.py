"""Results as data: JSONL rows written so that an interrupted run never leaves a torn row behind; files, arrays
and figures written atomically."""

from __future__ import annotations

import errno
import io
import json
import os
import stat
from pathlib import Path
from typing import Any, Iterator

from expertcache.jsonsafe import JSONError, loads


def named(exc: OSError, path: str | os.PathLike) -> OSError:
    """``exc`` naming ``path`` (errors of ``os.write``/``fsync`` on a descriptor carry no file name, so a full
    disk read "[Errno 28] No space left on device" without saying which output). Same errno, same subclass."""
    if exc.filename is not None:
        return exc
    return OSError(exc.errno, exc.strerror or str(exc), os.fspath(path))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file in the same folder, fsync, rename). A path that
    exists and is not a regular file (``/dev/null``, a FIFO) is written in place: never replaced. OSError naming
    ``path`` when it cannot be written (full disk, ...)."""
    path = Path(path)
    if path.exists() and not path.is_file():
        try:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
        except OSError as exc:
            raise named(exc, path) from None
        return
    from expertcache.outputs import temp_file

    try:
        tmp = temp_file(path)  # ends in .expertcache-tmp, fits the name limit
    except OSError as exc:
        raise named(exc, path) from None
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise named(exc, path) from None
        raise


def save_npy(path: str | os.PathLike, arr) -> None:
    """``numpy.save`` of ``arr`` to ``path``, atomically (:func:`atomic_write_bytes`)."""
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, arr)
    atomic_write_bytes(path, buf.getvalue())


_ROW_FILES: set[str] = set()  # files this process has checked to be row files (append_jsonl)


def append_jsonl(path: str | os.PathLike, row: dict[str, Any]) -> None:
    """Append one row as a single ``write`` of one line on an O_APPEND descriptor, then fsync: the row is
    whole or absent. A crash leaves at most a torn last line (readers skip it, see ``read_jsonl``); a failed or
    short write (a full disk) is cut off again (the file is truncated back to its size before the row) and
    raises OSError naming ``path``. The caller counts a row as written only when this returns. (Truncating back
    assumes one writer per file: ``sweep`` holds a lock on its output.) The first append of a process to a file
    checks that it is a row file (:func:`expertcache.outputs.check_row_file`): rows are never appended to a
    Markdown note or a trace (OutputError, a ValueError naming the file, the file untouched)."""
    from expertcache.outputs import check_row_file

    path = Path(path)
    key = os.path.realpath(path)
    if key not in _ROW_FILES:
        check_row_file(path, "rows file")
        _ROW_FILES.add(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(row, sort_keys=True, allow_nan=False) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise named(exc, path) from None
    try:
        before = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"No space left on device (short write: {written} of {len(data)} bytes)")
            if stat.S_ISREG(os.fstat(fd).st_mode):  # /dev/null, a pipe: nothing to sync (EINVAL)
                os.fsync(fd)
        except OSError as exc:
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.ftruncate(fd, before)  # no torn row left behind
            except OSError:
                pass
            raise named(exc, path) from None
    finally:
        os.close(fd)


def check_rows_out(parser, path, flag: str = "--out") -> None:
    """For the benchmark scripts: ``parser.error`` (exit 2, the message naming ``flag`` and the file) before any
    work unless rows may be appended to ``path`` (missing, empty, a row file or a stream;
    :func:`expertcache.outputs.check_row_file`, :func:`expertcache.outputs.check_stream`)."""
    from expertcache.outputs import check_row_file, check_stream

    if not path:
        return
    try:
        check_stream(path, flag)
        check_row_file(path, flag)
    except ValueError as exc:
        parser.error(str(exc))


def read_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Rows of a JSONL file; a torn (unterminated, unparsable) last line is skipped. ValueError naming the file
    (and line) for a file that is not UTF-8 or a line that is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 JSONL file (undecodable byte at offset {exc.start})") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield loads(line, what=f"{path}:{i + 1}")
        except JSONError:
            if i == len(lines) - 1:  # torn last line of an interrupted write
                return
            raise ValueError(f"{path}:{i + 1}: not a JSON row") from None


def pyplot():
    """``matplotlib.pyplot`` with the non-interactive Agg backend (matplotlib imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, *, tight: bool = True, **savefig) -> Path:
    """Lay ``fig`` out (``tight``), write it to ``path`` through a temporary file beside it (creating the folder;
    a reader never sees half a PNG), close it and return the path. ``savefig``: e.g. ``dpi``, ``bbox_inches``."""
    from expertcache.outputs import replace_file, temp_file

    path = Path(path)
    tmp = None
    try:
        tmp = temp_file(path)
        if tight:
            fig.tight_layout()
        fig.savefig(tmp, **{"format": path.suffix.lstrip(".") or None, **savefig})
        replace_file(tmp, path)  # a device (/dev/null) is written, never replaced
    except OSError as exc:
        raise named(exc, path) from None
    finally:
        pyplot().close(fig)
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return path
