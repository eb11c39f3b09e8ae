"""A quantised sidecar is bound to the checkpoint it was made from.

A sidecar's own checksums (:func:`~expertcache.offload.store.verify_quant_sidecar`) prove that its blobs are the ones
it wrote, not that they were made from *this* model: a sidecar copied from one model folder into another of the
same shape verified, was used, and ``--quant int8 --model M`` generated the other model's text. So the writer
records :func:`source_digest` -- a blake2b digest over every expert it packed: the expert's place (layer, id), its
packed layout (dtype, sizes, offsets) and its bytes as the checkpoint stores them -- in the sidecar's metadata
(:data:`SOURCE_KEY`), and a sidecar is read only when that digest equals the digest of the checkpoint it is
loaded for (:func:`check_bound`); any mismatch, or a sidecar without one, is rebuilt (one line on stderr).

The packed dense weights of ``--quant-dense`` (:mod:`expertcache.offload.densecache`) are named by
:func:`checkpoint_digest` of their source tensors -- each one's name, dtype, shape and bytes -- so a cache made
from other weights, or from the same names with edited values, is never read as this checkpoint's.

Cost: one sequential read and hash of the checkpoint's expert bytes (45-80 ms for granular's 11 MiB of experts on a
busy 2-core VM, so ~4-7 s per GiB: 18.9 s for an 8-layer OLMoE-1B-7B shape, most of a second start's time to the
first token). A digest is remembered for unchanged files, in the process and in
``$EXPERTCACHE_CACHE/digests/`` (one small JSON file per checkpoint and tensor set), keyed by every source file's
resolved path, size, device, inode, mtime and **ctime** (the kernel sets ctime at every change of a file's bytes
or times; no user-space call can set it back), so a later start reads the digest instead of the bytes; a changed,
replaced or touched file is hashed again. An unreadable or malformed memo is ignored (hashed again).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import sys
from pathlib import Path
from typing import Iterable

from expertcache.offload.checkpoint import CheckpointError
from expertcache.offload.quant import FORMAT_VERSION
from expertcache.outputs import env_path
from expertcache.results import atomic_write_bytes
from expertcache.tensorfile import read_metadata

__all__ = ["SOURCE_KEY", "source_digest", "sidecar_source", "check_bound", "check_sidecar_place", "check_not_newer", "bound_sidecar",
           "checkpoint_digest", "DIGEST_BYTES", "file_stamps", "recall", "remember", "VERIFIED_MARK", "was_verified",
           "mark_verified"]

#: the sidecar metadata key holding the digest of the checkpoint experts it was packed from
SOURCE_KEY = "source_digest"
#: blake2b digest size (hex: twice as many characters)
DIGEST_BYTES = 16
_CHUNK = 4 << 20  # under one packing block (PACK_ROWS rows of float32): the loading peak is unchanged
_MEMO: dict[tuple, str] = {}  # (checkpoint files' stamps, layers) -> digest, for this process


def file_stamps(files) -> tuple:
    """(resolved path, size, device, inode, mtime_ns, ctime_ns) of each of ``files``, sorted: equal stamps mean
    unchanged bytes (ctime moves with any write, truncate or utime)."""
    out = []
    for p in sorted({str(f) for f in files}):
        st = Path(p).stat()
        out.append((str(Path(p).resolve()), st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def _stamps(checkpoint, files=None) -> tuple:
    """:func:`file_stamps` of ``files`` (default: every file of ``checkpoint``)."""
    return file_stamps([t.file for t in checkpoint.entries.values()] if files is None else files)


def _memo_file(key: tuple) -> Path:
    root = env_path("EXPERTCACHE_CACHE") or Path.home() / ".cache" / "expertcache"
    return root / "digests" / f"{hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()}.json"


def recall(key: tuple) -> str | None:
    """The digest remembered for ``key`` (this process, then the memo file), or None."""
    got = _MEMO.get(key)
    if got is not None:
        return got
    try:
        rec = json.loads(_memo_file(key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("key") != repr(key):
        return None
    digest = rec.get("digest")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{%d}" % (2 * DIGEST_BYTES), digest):
        return None
    _MEMO[key] = digest
    return digest


def remember(key: tuple, digest: str) -> str:
    _MEMO[key] = digest
    try:  # a read-only or full cache folder only costs the next start a hash
        path = _memo_file(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps({"key": repr(key), "digest": digest}).encode())
    except OSError:
        pass
    return digest


#: what :func:`remember` records for a file whose checksums all held (:func:`mark_verified`)
VERIFIED_MARK = "0" * 32


def was_verified(path, kind: str, seen: set) -> bool:
    """Whether ``path``, as it is now (:func:`file_stamps`, ctime included), had its checksums verified: in this
    process (its stamps in ``seen``) or, through :func:`recall`, by an earlier one (then added to ``seen``)."""
    stamps = file_stamps([path])
    if stamps in seen:
        return True
    if recall((kind, stamps)) == VERIFIED_MARK:
        seen.add(stamps)
        return True
    return False


def mark_verified(path, kind: str, seen: set, *, across_processes: bool = True) -> None:
    """``path``'s checksums hold: its stamps added to ``seen`` (this process) and, ``across_processes`` (they were
    checked by reading the file back, not just written), remembered for later processes under ``kind``."""
    stamps = file_stamps([path])
    seen.add(stamps)
    if across_processes:
        remember((kind, stamps), VERIFIED_MARK)


def source_digest(checkpoint, layer_ids) -> str:
    """blake2b-128 (hex) over every expert of ``layer_ids`` of ``checkpoint`` (all ``checkpoint.num_experts``):
    ``layer:e:dtype:d:f:layout:offsets:nbytes`` then the bytes of each of its byte ranges, in file order."""
    layer_ids = tuple(int(i) for i in layer_ids)
    key = ("experts", _stamps(checkpoint), layer_ids, checkpoint.num_experts)
    got = recall(key)
    if got is not None:
        return got
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    buf = bytearray(_CHUNK)
    handles: dict[Path, int] = {}
    try:
        for layer in layer_ids:
            for e in range(checkpoint.num_experts):
                p = checkpoint.expert(layer, e)
                h.update(f"{layer}:{e}:{p.dtype}:{p.d}:{p.f}:{p.layout}:{p.gate_up_at}:{p.down_at}:"
                         f"{p.gate_up_bias_at}:{p.down_bias_at}:{p.nbytes};".encode())
                for r in p.reads:
                    fd = handles.get(r.file)
                    if fd is None:
                        fd = handles[r.file] = os.open(r.file, os.O_RDONLY)
                    h.update(struct.pack("<Q", r.nbytes))
                    _hash_range(h, fd, r.offset, r.nbytes, buf, r.file)
    finally:
        for fd in handles.values():
            os.close(fd)
    return remember(key, h.hexdigest())


def sidecar_source(path: str | os.PathLike) -> str | None:
    """The :data:`SOURCE_KEY` recorded in a sidecar's metadata (None: written before sidecars were bound)."""
    value = read_metadata(path).get(SOURCE_KEY)
    return value if isinstance(value, str) else None


def check_bound(path: str | os.PathLike, checkpoint, layer_ids) -> None:
    """CheckpointError naming the sidecar ``path`` unless it records the :func:`source_digest` of
    ``checkpoint``'s experts of ``layer_ids`` (made from another checkpoint, or before sidecars were bound)."""
    got = sidecar_source(path)
    if got is None:
        raise CheckpointError(f"{path}: quantised experts without the digest of the checkpoint they were made from "
                              "(an older expertcache)")
    if got != source_digest(checkpoint, layer_ids):
        raise CheckpointError(f"{path}: quantised experts made from another checkpoint than {checkpoint.folder} "
                              "(their experts' digest differs)")


def check_sidecar_place(path: str | os.PathLike) -> None:
    """CheckpointError naming ``path`` when something that is not a regular file (a folder) sits where the sidecar
    is to be written, or a sidecar of a newer format: it is the user's to remove, never replaced (and the error is
    not the temporary file's, nor "an older expertcache")."""
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not path.is_file():
        what = "a folder" if path.is_dir() else "not a regular file"
        raise CheckpointError(f"{path}: is {what}, where the quantised experts' sidecar goes; remove or rename it")
    if path.is_file():
        try:
            meta = read_metadata(path)
        except (OSError, ValueError):
            return  # unreadable: the checks that follow name it and rebuild it
        check_not_newer(path, meta)  # a newer expertcache's file: never rebuilt over


def check_not_newer(path: str | os.PathLike, meta: dict) -> None:
    """CheckpointError naming ``path`` when its metadata ``meta`` says a newer expertcache wrote it (a format
    above this one's: not read, and never replaced)."""
    version = meta.get("format_version", "1")
    if str(version).isdigit() and int(version) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: quantised experts in format {version}, written by a newer expertcache "
                              f"(this one reads format {FORMAT_VERSION}); not replaced: upgrade expertcache, or "
                              "delete the file and it is rebuilt in this format")


def bound_sidecar(path: str | os.PathLike, checkpoint, layer_ids) -> bool:
    """Whether the sidecar at ``path`` (beside a model) may be read for ``checkpoint``: False when there is none,
    and -- with one line on stderr -- when it was made from another checkpoint (the experts are then quantised
    from this one into the cache folder instead; the model folder is an input, never written)."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        check_bound(path, checkpoint, layer_ids)
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"expertcache: {exc}; not used: quantising {checkpoint.folder}'s experts into the cache folder",
              file=sys.stderr)
        return False
    return True




def checkpoint_digest(ckpt, keys: Iterable[str]) -> str:
    """Hex blake2b digest of the tensors ``keys`` of ``ckpt`` (a :class:`~expertcache.offload.checkpoint.Checkpoint`):
    for each key in sorted order, its name, dtype, shape and data bytes (read in chunks of 4 MiB: memory is
    one chunk). Raises CheckpointError for a key the checkpoint lacks or a file shorter than its header says."""
    keys = sorted(set(keys))
    for key in keys:
        if key not in ckpt.entries:
            raise CheckpointError(f"{ckpt.folder}: missing tensor {key!r}")
    memo = ("tensors", _stamps(ckpt, [ckpt.entries[k].file for k in keys]), tuple(keys))
    got = recall(memo)
    if got is not None:
        return got
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    buf = bytearray(_CHUNK)
    for key in keys:
        t = ckpt.entries[key]
        h.update(f"{key}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0{t.nbytes}\0".encode())
        with open(t.file, "rb", buffering=0) as f:
            _hash_range(h, f.fileno(), t.start, t.nbytes, buf, t.file)
    return remember(memo, h.hexdigest())


def _hash_range(h, fd: int, start: int, nbytes: int, buf: bytearray, name) -> None:
    """Feed bytes ``start`` .. ``start + nbytes`` of the open file ``fd`` to ``h``, a chunk of ``buf`` at a time
    (memory: one chunk); CheckpointError naming the file ``name`` where it ends before them (truncated)."""
    at, end = start, start + nbytes
    while at < end:
        view = memoryview(buf)[:min(len(buf), end - at)]
        got = os.preadv(fd, [view], at)
        if got <= 0:
            raise CheckpointError(f"{name}: truncated at byte {at} (the header says {end})")
        h.update(view[:got])
        at += got
