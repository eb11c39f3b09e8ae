"""Safetensors headers: which tensors one file holds and where their bytes lie, validated, read without loading.

A safetensors file is ``[u64 little-endian header length N][N bytes JSON header][data]``; the header maps
each key to ``{"dtype", "shape", "data_offsets": [begin, end]}`` with offsets relative to the data section.
:func:`read_header` parses and checks that header itself (no mmap of the file, no torch import of the
data), so a single tensor can be read with one ``pread`` of its byte range; :func:`index_shards` reads a sharded
checkpoint's index. Loud on damage: :class:`CheckpointError` (a ``ValueError``) naming the file and key.

Pure file format, at the bottom of the package (it imports only the JSON reader): the model loader's
config-vs-weights check (:mod:`expertcache.models.loader`) and the offloaded runtime's checkpoint reader
(:mod:`expertcache.offload.checkpoint`, which re-exports these names) both read headers here.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from expertcache.jsonsafe import JSONError, load_path, loads

__all__ = ["CheckpointError", "TensorEntry", "read_header", "read_metadata", "index_shards", "DTYPES"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 2**20  # the safetensors reference implementation refuses headers above 100 MB


class CheckpointError(ValueError):
    """A checkpoint file is damaged, truncated, or lacks a tensor the model needs."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: ``start`` is the absolute byte offset of its data in ``file``."""

    file: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


#: read_header's memo: (path as given, size, device, inode, mtime_ns, ctime_ns) -> its entries, for this process
_HEADERS: dict[tuple, dict[str, "TensorEntry"]] = {}
_HEADERS_KEPT = 64


def read_header(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, validated against the file size (see the module docstring).
    Parsed once per process for an unchanged file (remembered by its path, size, inode, mtime and ctime: a
    ``generate`` start asks for the checkpoint's header six times; 16 ms a parse for a 4-layer OLMoE-1B-7B shape's
    807 tensors, 0.1 ms remembered); a new dict each call.

    Raises CheckpointError for any inconsistency, FileNotFoundError if the file does not exist."""
    path = Path(path)
    st = path.stat()
    stamp = (str(path), st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
    got = _HEADERS.get(stamp)
    if got is None:
        got = _parse_header(path, st.st_size)
        if len(_HEADERS) >= _HEADERS_KEPT:
            _HEADERS.pop(next(iter(_HEADERS)))
        _HEADERS[stamp] = got
    return dict(got)


def _parse_header(path: Path, size: int) -> dict[str, TensorEntry]:
    if size < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} does not fit in the file of {size} bytes "
                                  "(truncated, or not a safetensors file)")
        raw = f.read(n)
    try:
        header = loads(raw, what="header")
    except JSONError as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    base = 8 + n
    out: dict[str, TensorEntry] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: corrupt header entry for {key!r} ({exc!r})") from None
        itemsize = torch.empty((), dtype=dtype).element_size()
        expected = math.prod(shape) * itemsize
        if not 0 <= begin <= end or end - begin != expected:
            raise CheckpointError(f"{path}: tensor {key!r} has data_offsets [{begin}, {end}] but dtype "
                                  f"{info['dtype']} × shape {list(shape)} needs {expected} bytes (corrupt header)")
        if base + end > size:
            raise CheckpointError(f"{path}: tensor {key!r} ends at byte {base + end} but the file has only "
                                  f"{size} bytes (truncated file)")
        out[key] = TensorEntry(path, key, dtype, shape, base + begin, end - begin)
    spans = sorted((e.start, e.start + e.nbytes, k) for k, e in out.items() if e.nbytes)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:  # two tensors on one byte range: one file's bytes would be both weights
            raise CheckpointError(f"{path}: tensors {a!r} and {b!r} share bytes {begin}..{end} (corrupt header)")
    return out


def read_metadata(path: str | os.PathLike) -> dict:
    """The ``__metadata__`` object of one safetensors file's header ({} where it has none). Raises
    CheckpointError for a header that does not fit the file or is not a JSON object, OSError if unreadable."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (size,)
        if n > _MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} does not fit in the file of {size} bytes "
                                  "(truncated, or not a safetensors file)")
        try:
            header = loads(f.read(n), what=str(path))
        except JSONError as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(header, dict) or not isinstance(meta, (dict, type(None))):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    return meta or {}


def index_shards(folder: str | os.PathLike) -> list[Path] | None:
    """The shard files named by ``folder/model.safetensors.index.json`` (None without an index), each checked to be
    a plain file name inside ``folder``: an index naming ``../elsewhere`` or ``/etc/passwd`` would make a model folder
    read outside itself. CheckpointError naming the index otherwise."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        names = set(load_path(index)["weight_map"].values())
    except JSONError as exc:
        raise CheckpointError(f"corrupt shard index: {exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index}: corrupt shard index ({exc!r})") from None
    root = folder.resolve()
    for name in names:
        if not isinstance(name, str) or not name or Path(name).is_absolute() or \
                root not in (root / name).resolve().parents:
            raise CheckpointError(f"{index}: shard {name!r} is not a file inside the model folder; refused")
    return [folder / name for name in sorted(names)]
