"""What binds a derived file (packed dense weights, a quantised sidecar) to the checkpoint it was made from: a
digest of the source tensors -- each one's name, dtype and shape (its header) and its bytes -- so a cache
made from other weights, or from the same names with edited values, is never read as this checkpoint's.

Reading every source byte costs one sequential pass over them (blake2b: about 1 GB/s a core), far less than
the quantisation it lets a second start skip; file sizes and times are not used (a copy of the checkpoint
elsewhere binds to the same cache, an edit in place with the same size does not).
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable

__all__ = ["checkpoint_digest", "DIGEST_BYTES"]

#: blake2b digest size (hex: twice as many characters)
DIGEST_BYTES = 16
_CHUNK = 4 << 20  # under one packing block (PACK_ROWS rows of float32): the loading peak is unchanged


def checkpoint_digest(ckpt, keys: Iterable[str]) -> str:
    """Hex blake2b digest of the tensors ``keys`` of ``ckpt`` (a :class:`~expertcache.offload.checkpoint.Checkpoint`):
    for each key in sorted order, its name, dtype, shape and data bytes (read in chunks of 4 MiB: memory is
    one chunk). Raises CheckpointError for a key the checkpoint lacks or a file shorter than its header says."""
    from expertcache.offload.checkpoint import CheckpointError

    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    buf = bytearray(_CHUNK)
    for key in sorted(set(keys)):
        t = ckpt.entries.get(key)
        if t is None:
            raise CheckpointError(f"{ckpt.folder}: missing tensor {key!r}")
        h.update(f"{key}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0{t.nbytes}\0".encode())
        with open(t.file, "rb", buffering=0) as f:
            at, end = t.start, t.start + t.nbytes
            while at < end:
                view = memoryview(buf)[:min(_CHUNK, end - at)]
                got = os.preadv(f.fileno(), [view], at)
                if got <= 0:
                    raise CheckpointError(f"{t.file}: short read of {key!r} (truncated file)")
                h.update(view[:got])
                at += got
    return h.hexdigest()
