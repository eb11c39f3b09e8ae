"""Packed dense weights (``--quant-dense``) cached on disk, so a second start reads them instead of packing again
(as llama.cpp reads a quantised file): one safetensors file a checkpoint, recipe and kernel layout, under
``$EXPERTCACHE_CACHE/dense/``.

- **Bound to its checkpoint**: the file name carries :func:`~expertcache.offload.binding.checkpoint_digest` of
  the source tensors (headers and bytes), and the metadata repeats it with the recipe (mode, group, kernel layout,
  compute dtype, format): weights edited in place, or another checkpoint, miss the cache and are packed afresh.
- **Checked when read**: a blake2b digest of every packed byte (tensor ``__checksum__``, written last) is
  recomputed while reading; a damaged, truncated or foreign file is packed again and rewritten (a note on stderr),
  never used. A file whose checksum held is remembered by its stamps (:func:`~expertcache.offload.binding.
  mark_verified`: path, size, inode, mtime, ctime; in this process and in ``$EXPERTCACHE_CACHE/digests/``), as
  the quantised sidecar is: a later start reads it without hashing it again, until the file changes.
- **Written atomically** (:func:`~expertcache.offload.writer.write_safetensors`: a temporary file, renamed): an
  interrupted start leaves no file that looks valid. A cache folder that cannot be written costs only the cache
  (a note on stderr; the packed weights are in memory either way).

Keys: ``{weight name}:{buffer}`` for each packed module's buffers (QuantLinear: ``qweight``, ``scales``;
QuantEmbedding: ``codes``, ``scales``). Reading fills the modules' buffers in place, one tensor at a time (no
second copy of the dense part), then drops the file's pages from the page cache (none left charged to a cgroup).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from expertcache.offload.binding import checkpoint_digest, mark_verified, was_verified
from expertcache.offload.checkpoint import CheckpointError, read_header
from expertcache.offload.writer import write_safetensors
from expertcache.tensorfile import read_metadata

__all__ = ["DENSE_CACHE_VERSION", "dense_cache_path", "load_or_pack_dense"]

#: the packed-dense file's format (bump when a layout or a recipe's meaning changes)
DENSE_CACHE_VERSION = 1
_CHECKSUM = "__checksum__"
_KIND = "dense-verified"  # binding.mark_verified's memo of the files whose checksum held
_VERIFIED: set[tuple] = set()  # binding.file_stamps of the files verified (or written) by this process


def _buffers(mod: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, b) for n, b in mod.named_buffers(recurse=False)]


def _recipe(packed: dict[str, nn.Module]) -> dict[str, str]:
    """What the packed bytes depend on besides the weights: each module's mode, group, kernel layout, dtype."""
    kinds = sorted({getattr(m, "recipe", type(m).__name__) for m in packed.values()})
    dtypes = sorted({str(b.dtype).removeprefix("torch.") for m in packed.values() for _, b in _buffers(m)})
    return {"format_version": str(DENSE_CACHE_VERSION), "recipe": ";".join(kinds), "dtypes": ",".join(dtypes)}


def dense_cache_path(folder: Path, digest: str, packed: dict[str, nn.Module]) -> Path:
    """``folder/expertcache-dense-v{N}-{recipe hash}-{checkpoint digest}.safetensors``."""
    r = hashlib.blake2b(repr(sorted(_recipe(packed).items())).encode(), digest_size=6).hexdigest()
    return Path(folder) / f"expertcache-dense-v{DENSE_CACHE_VERSION}-{r}-{digest}.safetensors"


def _read(path: Path, packed: dict[str, nn.Module], digest: str) -> None:
    """Fill ``packed``'s buffers from ``path``; CheckpointError (the buffers then half-filled) unless the file
    holds exactly these tensors, for this recipe and digest, and its checksum verifies."""
    entries = read_header(path)
    meta = read_metadata(path)
    want = dict(_recipe(packed), checkpoint_digest=digest)
    diff = [k for k, v in want.items() if meta.get(k) != v]
    if diff:
        raise CheckpointError(f"{path}: packed dense weights for another {', '.join(diff)}")
    keys = [f"{name}:{b}" for name, m in packed.items() for b, _ in _buffers(m)]
    if sorted(entries) != sorted(keys + [_CHECKSUM]):
        raise CheckpointError(f"{path}: holds other tensors than this model's packed dense weights")
    known = was_verified(path, _KIND, _VERIFIED)  # checked before, and unchanged since: read, not hashed
    h = _new_hash()
    with open(path, "rb", buffering=0) as f:
        for name, m in packed.items():
            for b, t in _buffers(m):
                e = entries[f"{name}:{b}"]
                if e.dtype != t.dtype or tuple(e.shape) != tuple(t.shape):
                    raise CheckpointError(f"{path}: {name}:{b} is {e.dtype} {list(e.shape)}, the model packs "
                                          f"{t.dtype} {list(t.shape)}")
                host = t if t.device.type == "cpu" and t.is_contiguous() else torch.empty_like(t, device="cpu")
                view = memoryview(host.view(torch.uint8).reshape(-1).numpy()) if host.numel() else memoryview(b"")
                if os.preadv(f.fileno(), [view], e.start) != e.nbytes:
                    raise CheckpointError(f"{path}: short read of {name}:{b} (truncated file)")
                if not known:
                    h.update(view)
                if host is not t:
                    t.copy_(host)
        if known:
            _drop_cached(f.fileno())
            return
        c = entries[_CHECKSUM]
        stored = os.pread(f.fileno(), c.nbytes, c.start)
        _drop_cached(f.fileno())
    if stored != h.digest():
        raise CheckpointError(f"{path}: checksum mismatch (damaged file)")
    mark_verified(path, _KIND, _VERIFIED)


def _drop_cached(fd: int) -> None:
    """The file's pages leave the page cache once copied into the buffers (``posix_fadvise(DONTNEED)``; where
    there is none, nothing): inside a memory cgroup they are charged to it, a second copy of the dense part
    (327 MiB for ``--quant q4`` on OLMoE's shapes) until the kernel reclaims it."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def _new_hash():
    return hashlib.blake2b(digest_size=16)


def _write(path: Path, packed: dict[str, nn.Module], digest: str) -> Path:
    h = _new_hash()

    def make(t):
        def f():
            host = t.detach().to("cpu").contiguous()
            h.update(memoryview(host.view(torch.uint8).reshape(-1).numpy()) if host.numel() else b"")
            return host
        return f

    entries = [(f"{name}:{b}", t.dtype, tuple(t.shape), make(t)) for name, m in packed.items() for b, t in _buffers(m)]
    entries.append((_CHECKSUM, torch.uint8, (16,), lambda: torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)))
    meta = {"format": "pt", "expertcache": "packed-dense", **_recipe(packed), "checkpoint_digest": digest,
            "checksum": f"blake2b-128 of every packed byte in key order, in {_CHECKSUM}"}
    out = write_safetensors(path, entries, meta)
    mark_verified(out, _KIND, _VERIFIED, across_processes=False)  # written, not read back: the next process checks it
    return out


def load_or_pack_dense(packed: dict[str, nn.Module], pack: Callable[[], None], ckpt, source_keys: list[str],
                       folder: Path | None, *, log=None) -> dict:
    """Fill ``packed`` (weight name -> module whose buffers hold the packed weight) from the cache file bound to
    ``ckpt``'s ``source_keys``, or, when there is none (or it is unusable), by calling ``pack()`` and then
    writing the file. ``folder`` None: no cache (``pack()`` only). Returns {"dense_cache": "read" | "written" |
    "off" | "unwritable", "path", "seconds"} for the log and the bench rows."""
    log = log or (lambda msg: print(f"expertcache: {msg}", file=sys.stderr))
    t0 = time.perf_counter()
    if folder is None or not packed:
        pack()
        return {"dense_cache": "off", "path": None, "seconds": time.perf_counter() - t0}
    digest = checkpoint_digest(ckpt, source_keys)
    path = dense_cache_path(folder, digest, packed)
    if path.is_file():
        try:
            _read(path, packed, digest)
            return {"dense_cache": "read", "path": str(path), "seconds": time.perf_counter() - t0}
        except (CheckpointError, OSError) as exc:
            log(f"{exc}; packing the dense weights again")
    pack()
    try:
        _write(path, packed, digest)
        state = "written"
    except OSError as exc:
        log(f"packed dense weights not cached ({exc})")
        state = "unwritable"
    return {"dense_cache": state, "path": str(path), "seconds": time.perf_counter() - t0}
