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
  is cut off only then, never the last line of some other file;
* the inputs are what a command reads *however it found them*: paths on the command line, the shipped models
  and traces (found by name, e.g. ``--model granular``), the data folder (``--data-dir``, ``$EXPERTCACHE_DATA``
  or ``../shared/data``) and the expert cache folder of quantised sidecars (:func:`implicit_inputs`); no existing
  file inside an input folder is replaced or appended to;
* an output that exists and is not a regular file, a folder or a character device (a FIFO, a socket, a disk)
  is refused before the work -- writing it would block, go nowhere or destroy a disk -- except the documented
  streams ``/dev/stdout`` (also written ``-``), ``/dev/stderr`` and ``/dev/null``; streams and character devices
  are written in place (no lock file or temporary file beside them, never replaced);
* a command that writes named files into a folder it does not own (``report``, ``analyze --out-dir``) replaces
  only the files it wrote there before, as recorded in :data:`FILES_MARK`, unchanged since
  (:func:`claim_names`); a file of the user's of the same name is refused, never replaced;
* temporary names fit the file system's name limit (the output's name is shortened in them), so a valid long
  output name never fails after the work.

Pure path logic, no torch; errors are :class:`OutputError` (a ``ValueError``) naming the flag and the path.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

__all__ = ["MARK", "FILES_MARK", "TMP_SUFFIX", "STREAMS", "OutputError", "check_args", "check_not_input",
           "check_folder_output", "claim_run_folder", "check_row_file", "mark_folder", "publish_folder", "temp_folder", "temp_file",
           "replace_file", "is_stream", "implicit_inputs", "env_path", "claim_names", "record_names", "name_max",
           "OUTPUT_DESTS"]

#: the file inside a folder written by an expertcache command, naming the command
MARK = ".expertcache-output.json"
#: every temporary file or folder of an output ends with this (never a user's name: created exclusively)
TMP_SUFFIX = ".expertcache-tmp"
#: the file inside a folder that a command writes named files into (``report``, ``analyze``) listing them
FILES_MARK = ".expertcache-files.json"
#: the outputs that are not regular files but are accepted (written in place, nothing created beside them)
STREAMS = ("/dev/stdout", "/dev/stderr", "/dev/null")

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
    ``"t.trace (trace)"``), when it would replace or append to an existing file inside an input folder (a
    model's weights, a data set's rows), or, for an output folder that is replaced (``replaces_folder``), when it
    holds an input. ``appends``: kept for callers; an append changes an input's file as much as a write."""
    if out in (None, ""):
        return
    for label, inp in inputs.items():
        if inp in (None, ""):
            continue
        if _same(out, inp):
            raise OutputError(f"{flag} {out}: is the input {label}; refusing to overwrite it (give another {flag})")
        if replaces_folder and _inside(inp, out):
            raise OutputError(f"{flag} {out}: holds the input {label} and would be replaced; give another {flag}")
        if not replaces_folder and os.path.isfile(out) and Path(inp).is_dir() and _inside(out, inp):
            what = "append to" if appends else "replace"
            raise OutputError(f"{flag} {out}: would {what} a file of the input folder {label}; give another {flag}")


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


def claim_run_folder(path, flag: str, command: str, legacy=()) -> Path:
    """A run folder (``train --out``, ``melinoe finetune --out``: the command writes its logs, checkpoints and data
    caches there by name and resumes from them): refused when it exists, is not empty and is not this command's
    -- marked (:data:`MARK`) by it, or, from before marks, holding one of ``legacy`` (its checkpoint, its marked
    ``model/``) -- so a user's ``log.jsonl`` there is never truncated. Creates and marks it; returns it."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise OutputError(f"{flag} {path}: exists and is not a folder")
    if p.is_dir() and any(p.iterdir()) and _marked_by(p) != command:
        old = any((p / name).is_file() or _marked_by(p / name) == command for name in legacy)
        if not old:
            by = _marked_by(p)
            what = f"was written by `expertcache {by}`" if by else f"is not a `{command}` run folder"
            raise OutputError(f"{flag} {path}: the folder exists and {what}; refusing to write into it (give a new "
                              "folder, or remove it yourself)")
    p.mkdir(parents=True, exist_ok=True)
    if _marked_by(p) != command:
        mark_folder(p, command)
    return p


def mark_folder(folder, command: str) -> None:
    """Write :data:`MARK` (naming ``command``) into ``folder``: the command may replace it on a later run."""
    import json

    (Path(folder) / MARK).write_text(json.dumps({"command": command}) + "\n")


def name_max(folder) -> int:
    """The longest file name (bytes) the file system of ``folder`` takes (255 where it does not say)."""
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return 255


#: the random part ``mkstemp``/``mkdtemp`` put between prefix and suffix
_RANDOM = 8


def _temp_prefix(final: Path) -> str:
    """``.<name>.`` with ``<name>`` shortened (whole UTF-8 characters) so that the temporary name -- prefix,
    random part, :data:`TMP_SUFFIX` -- fits the folder's name limit even when the output's name is at it."""
    room = name_max(final.parent) - 2 - _RANDOM - len(TMP_SUFFIX)
    name = final.name
    while name and len(os.fsencode(name)) > room:
        name = name[:-1]
    return f".{name}."


def temp_folder(final) -> Path:
    """A new, empty folder beside ``final`` for building it (created exclusively: never a user's folder)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=_temp_prefix(final), suffix=TMP_SUFFIX, dir=final.parent))


def temp_file(final) -> Path:
    """A new, empty file beside ``final`` for writing it (created exclusively: never a user's file; its name
    ends in :data:`TMP_SUFFIX` and fits the name limit)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=_temp_prefix(final), suffix=TMP_SUFFIX, dir=final.parent)
    os.close(fd)
    return Path(name)


def is_stream(path) -> bool:
    """Whether ``path`` is one of the accepted non-file outputs (:data:`STREAMS`, or ``-``)."""
    return str(path) == "-" or str(path) in STREAMS


def replace_file(tmp, final) -> None:
    """Put the finished temporary file ``tmp`` in place of ``final``: renamed over it, or -- for a stream
    (:data:`STREAMS`: ``/dev/null``, ``/dev/stdout``) that exists and is not a regular file -- its bytes copied
    into it and ``tmp`` removed (a device is never replaced by a file)."""
    tmp, final = Path(tmp), Path(final)
    if final.exists() and not final.is_file() and not final.is_dir():
        with open(tmp, "rb") as src, open(final, "wb") as dst:
            shutil.copyfileobj(src, dst)
        tmp.unlink(missing_ok=True)
        return
    os.replace(tmp, final)


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


def env_path(name: str):
    """The folder or file named by the environment variable ``name`` as a ``Path`` (``~`` expanded), or None when
    it is unset, empty or only blanks: an empty variable is "not set", never the current folder (``Path("")``
    is ``.``)."""
    value = os.environ.get(name, "")
    return Path(value).expanduser() if value.strip() else None


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _hub_cache() -> Path:
    """The Hugging Face hub cache folder ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    return env_path("HF_HUB_CACHE") or (env_path("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"


def implicit_inputs(values: dict) -> dict[str, str]:
    """The inputs a command reads that its command line does not spell as paths (``{label: path}``): the
    shipped models and traces (every command may read them: ``--model granular``, ``analyze`` without a trace,
    the shipped tokenizer); the data folder of a command with ``--data-dir`` (its value, else
    ``$EXPERTCACHE_DATA``, else ``<repo>/../shared/data``); the expert cache folder (quantised sidecars, bench
    models) of every command that can read a model."""
    found: dict[str, str] = {}
    assets = Path(__file__).resolve().parent / "assets"
    for dest, value in values.items():
        if dest in OUTPUT_DESTS or dest.startswith("_") or not isinstance(value, str):
            continue
        if value in ("granular", "coarse") and not os.path.lexists(value):
            found[f"{value} (--{dest.replace('_', '-')}, the shipped model)"] = str(assets / "models" / value)
        elif dest == "model" and _HUB_NAME.fullmatch(value) and not os.path.lexists(value):
            hub = _hub_cache() / f"models--{value.replace('/', '--')}"
            if hub.is_dir():  # a hub model's local copy (the hub cache): read by name, an input like a folder
                found[f"{value} (--model, the hub cache's copy {hub})"] = str(hub)
    found[f"{assets} (the shipped models and traces)"] = str(assets)
    if "data_dir" in values:
        root = values.get("data_dir") or env_path("EXPERTCACHE_DATA") or \
            Path(__file__).resolve().parents[2].parent / "shared" / "data"
        if os.path.isdir(root):
            found[f"{root} (the data folder: --data-dir, $EXPERTCACHE_DATA or ../shared/data)"] = str(root)
    if "model" in values or "quant" in values:
        cache = env_path("EXPERTCACHE_CACHE") or Path.home() / ".cache" / "expertcache"
        if os.path.isdir(cache):
            found[f"{cache} (the expert cache folder: $EXPERTCACHE_CACHE)"] = str(cache)
    return found


def check_stream(out, flag: str) -> None:
    """Refuse an output that exists and is neither a regular file nor a folder (a FIFO would block the command
    after its work, a socket or a device takes nothing), unless it is one of :data:`STREAMS`."""
    if is_stream(out):
        return
    try:
        st = os.stat(Path(out).expanduser())
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISCHR(st.st_mode):
        return  # a character device (/dev/full, a terminal) is written in place, never replaced
    kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
            else "a block device" if stat.S_ISBLK(st.st_mode) else "not a regular file")
    raise OutputError(f"{flag} {out}: is {kind}, not a regular file; give a file name (or {', '.join(STREAMS)})")


def _digest(path: Path) -> str | None:
    import hashlib

    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def _recorded(folder: Path) -> dict:
    from expertcache.jsonsafe import load_path

    try:
        doc = load_path(folder / FILES_MARK)
    except (OSError, ValueError):
        return {}
    files = doc.get("files") if isinstance(doc, dict) else None
    return files if isinstance(files, dict) else {}


def claim_names(folder, names, flag: str, command: str, inputs: dict | None = None) -> None:
    """Before a command writes ``names`` (file names) into ``folder``: refuse (naming ``flag`` and the file) a
    name that is one of ``inputs`` (``{label: path}``), or that exists and is not a file this ``command`` wrote
    there (recorded in :data:`FILES_MARK` with its digest, unchanged since) -- a user's ``pareto.md`` or
    ``analysis_summary.json`` is never replaced."""
    folder = Path(folder).expanduser()
    rec = _recorded(folder)
    for name in names:
        path = folder / name
        check_not_input(path, flag, inputs or {})
        if not os.path.lexists(path):
            continue
        mine = rec.get(name)
        if not (isinstance(mine, dict) and mine.get("command") == command and path.is_file()
                and not path.is_symlink() and mine.get("sha256") == _digest(path)):
            raise OutputError(f"{flag} {folder}: holds {name}, which this command did not write (or it was "
                              f"changed since); refusing to replace it (give another {flag}"
                              f"{', or a --prefix' if command == 'report' else ''}, or remove it yourself)")


def record_names(folder, names, command: str) -> None:
    """After a command wrote ``names`` into ``folder``: record them, with their digests, in :data:`FILES_MARK`
    (so that its next run may replace them, and nothing else)."""
    import json

    folder = Path(folder)
    rec = _recorded(folder)
    for name in names:
        rec[name] = {"command": command, "sha256": _digest(folder / name)}
    tmp = temp_file(folder / FILES_MARK)
    try:
        tmp.write_text(json.dumps({"files": rec}, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, folder / FILES_MARK)
    finally:
        tmp.unlink(missing_ok=True)


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
    for dest in OUTPUT_DESTS:  # ``-`` is stdout
        if values.get(dest) == "-" and dest not in ("out_dir", "fig"):
            setattr(args, dest, "/dev/stdout")
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
    inputs.update(implicit_inputs(values))
    args.inputs_read = inputs  # for the commands that check the names they write later (claim_names)
    rows = values.get("row_outputs") or ()
    for dest in OUTPUT_DESTS:
        for out in _paths_of(values.get(dest)):
            check_stream(out, _flag(dest))
            check_not_input(out, _flag(dest), inputs, replaces_folder=dest in replaced, appends=dest in rows)
    for dest, folder in replaced.items():
        check_folder_output(folder, _flag(dest), values.get("writer") or command)
    for dest in values.get("row_outputs") or ():
        check_row_file(values.get(dest), _flag(dest))
