"""The one output rule: no command may damage a file or folder of the user's.

Every command that writes follows it, checked before any work (:func:`check_args` runs for every command in
``expertcache.cli.main`` before the command itself):

* an output path that is -- or resolves to, through links, ``..`` or a hard link -- one of the command's
  inputs is refused; so is an output folder that would be replaced while it holds an input;
* a folder output is replaced only when it is empty or when *this command* wrote it before (it then holds
  :data:`MARK`, a small JSON file naming the command); any other existing folder is refused;
* temporary files and folders are created exclusively (``mkstemp``/``mkdtemp``) under names that end in
  ``.expertcache-tmp`` beside the output, so they can never be a user's, and are removed on every failure;
* rows are appended (``simulate``, ``sweep``, ``eval``, ``mole eval``) only to a file that already is a row
  file -- empty, or JSON objects one per line (:func:`check_row_file`); a torn last row of an interrupted run
  is cut off only then, never the last line of some other file.

Pure path logic, no torch; errors are :class:`OutputError` (a ``ValueError``) naming the flag and the path.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

__all__ = ["MARK", "TMP_SUFFIX", "OutputError", "check_args", "check_not_input", "check_folder_output",
           "check_row_file", "mark_folder", "publish_folder", "temp_folder", "temp_file", "OUTPUT_DESTS"]

#: the file inside a folder written by an expertcache command, naming the command
MARK = ".expertcache-output.json"
#: every temporary file or folder of an output ends with this (never a user's name: created exclusively)
TMP_SUFFIX = ".expertcache-tmp"

#: argparse destinations that are outputs (every other path-valued flag or argument is an input)
OUTPUT_DESTS = ("out", "out_dir", "trace_out", "profile_out", "fig")


class OutputError(ValueError):
    """An output path that would damage an input or a user's file or folder."""


def _real(path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def _same(a: Path, b: Path) -> bool:
    if _real(a) == _real(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:
        return False


def _inside(child: Path, parent: Path) -> bool:
    c, p = _real(child), _real(parent)
    return c != p and p in c.parents


def check_not_input(out, flag: str, inputs: dict, *, replaces_folder: bool = False, appends: bool = False) -> None:
    """Refuse ``out`` (given as ``flag``) when it is one of ``inputs`` (``{label: path}``, label e.g.
    ``"t.trace (trace)"``), when it would replace an existing file inside an input folder (a model's weights; not
    for ``appends``: rows appended to a row file there), or, for an output folder that is replaced
    (``replaces_folder``), when it holds an input."""
    if out in (None, ""):
        return
    for label, inp in inputs.items():
        if inp in (None, ""):
            continue
        if _same(out, inp):
            raise OutputError(f"{flag} {out}: is the input {label}; refusing to overwrite it (give another {flag})")
        if replaces_folder and _inside(inp, out):
            raise OutputError(f"{flag} {out}: holds the input {label} and would be replaced; give another {flag}")
        if not (replaces_folder or appends) and os.path.isfile(out) and Path(inp).is_dir() and _inside(out, inp):
            raise OutputError(f"{flag} {out}: would replace a file of the input folder {label}; give another {flag}")


def _marked_by(folder: Path) -> str | None:
    from expertcache.jsonsafe import load_path

    try:
        doc = load_path(folder / MARK)
    except (OSError, ValueError):
        return None
    return doc.get("command") if isinstance(doc, dict) else None


def check_folder_output(path, flag: str, command: str) -> None:
    """Refuse a folder output that exists, is not empty and was not written by ``command`` (no :data:`MARK`
    naming it): replacing it would delete the user's files. A file where the folder goes is refused too."""
    if path in (None, ""):
        return
    p = Path(path).expanduser()
    if not p.name or p.resolve() == Path(p.resolve().anchor):
        raise OutputError(f"{flag} {path}: give a folder name to write (this would replace {p.resolve()})")
    if not p.exists() and not p.is_symlink():
        return
    if not p.is_dir():
        raise OutputError(f"{flag} {path}: exists and is not a folder")
    if not any(p.iterdir()):
        return
    by = _marked_by(p)
    if by != command:
        what = f"was written by `expertcache {by}`" if by else "is not one this command wrote"
        raise OutputError(f"{flag} {path}: the folder exists and {what}; refusing to replace it (give a new "
                          f"folder, or remove it yourself)")


def mark_folder(folder, command: str) -> None:
    """Write :data:`MARK` (naming ``command``) into ``folder``: the command may replace it on a later run."""
    import json

    (Path(folder) / MARK).write_text(json.dumps({"command": command}) + "\n")


def temp_folder(final) -> Path:
    """A new, empty folder beside ``final`` for building it (created exclusively: never a user's folder)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=TMP_SUFFIX, dir=final.parent))


def temp_file(final) -> Path:
    """A new, empty file beside ``final`` for writing it (created exclusively: never a user's file)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=TMP_SUFFIX, dir=final.parent)
    os.close(fd)
    return Path(name)


def publish_folder(tmp, final, command: str) -> Path:
    """Put the finished folder ``tmp`` (from :func:`temp_folder`) in place of ``final``: its files made
    world-readable (safetensors writes 0600), marked as written by ``command``; a previous ``final`` -- only one
    :func:`check_folder_output` allows -- is moved aside under a temporary name and removed after the swap, so an
    interrupted run never leaves a half-written ``final``. Returns ``final``."""
    tmp, final = Path(tmp), Path(final)
    check_folder_output(final, "output", command)  # the rule holds for library callers too
    mark_folder(tmp, command)
    for f in tmp.iterdir():
        if f.is_file():
            f.chmod(0o644)
    tmp.chmod(0o755)
    old = None
    if final.is_dir():
        old = temp_folder(final)
        os.replace(final, old / final.name)
    elif final.exists() or final.is_symlink():
        final.unlink()  # an empty-folder symlink or nothing else check_folder_output allows
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def check_row_file(path, flag: str) -> None:
    """Refuse appending rows to ``path`` unless it is missing, empty, not a regular file (a device, a FIFO) or a
    row file: UTF-8 lines that are each a JSON object, the last possibly torn (an interrupted row starting
    ``{``). A text file, a trace, a JSON document of something else: refused, untouched."""
    from expertcache.jsonsafe import loads

    if path in (None, ""):
        return
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except OSError:
        return
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
        return
    with open(p, "rb") as f:
        data = f.read()
    bad = f"{flag} {path}: not a file of JSON rows"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise OutputError(f"{bad} (not UTF-8 text); refusing to append to it") from None
    lines = text.split("\n")
    complete, tail = lines[:-1], lines[-1]
    for i, line in enumerate(complete):
        if not line.strip():
            continue
        try:
            row = loads(line, what=f"{path}:{i + 1}")
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise OutputError(f"{bad} (line {i + 1} is not a JSON object); refusing to append to it")
    if tail.strip() and not (tail.lstrip().startswith("{") and any(x.strip() for x in complete)):
        raise OutputError(f"{bad} (its last line is not a JSON row); refusing to append to it")


def _paths_of(value) -> list[str]:
    if isinstance(value, (str, os.PathLike)) and str(value):
        return [str(value)]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value if isinstance(v, (str, os.PathLike)) and str(v)]
    return []


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_args(args, command: str) -> None:
    """The rule for one parsed command line: every output flag (:data:`OUTPUT_DESTS`) against every other
    argument that names an existing path (the inputs), and the folder outputs the command replaces
    (``args.replaced_folders``: destinations, or ``(dest, subfolder)``) against existing folders of the user's
    (``args.writer``: the command named in their mark, default ``command``); the row files a command appends to
    (``args.row_outputs``) against files that are not row files. Commands declare these with ``set_defaults``."""
    values = vars(args)
    inputs: dict[str, str] = {}
    for dest, value in values.items():
        if dest in OUTPUT_DESTS or dest.startswith("_"):
            continue
        for v in _paths_of(value):
            if "=" in v and not os.path.lexists(v):  # report's --trace FILE=LABEL
                v = v.split("=", 1)[0]
            if v and os.path.lexists(v):
                inputs[f"{v} ({dest.replace('_', '-')})"] = v
    replaced = {}
    for item in values.get("replaced_folders") or ():
        dest, sub = (item, None) if isinstance(item, str) else item
        if values.get(dest):
            replaced[dest] = Path(values[dest]) / sub if sub else Path(values[dest])
    rows = values.get("row_outputs") or ()
    for dest in OUTPUT_DESTS:
        for out in _paths_of(values.get(dest)):
            check_not_input(out, _flag(dest), inputs, replaces_folder=dest in replaced, appends=dest in rows)
    for dest, folder in replaced.items():
        check_folder_output(folder, _flag(dest), values.get("writer") or command)
    for dest in values.get("row_outputs") or ():
        check_row_file(values.get(dest), _flag(dest))
