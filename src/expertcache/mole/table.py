"""MoLE lookup tables on disk: export (re-parameterisation) and the per-token reader.

A table folder (``expertcache mole export MODEL_DIR --out TABLE``) is a Hugging Face model folder of the *table form*:

    config.json         MoleConfig with ``lookup_table`` = the table description below
    model.safetensors   the trunk (embedding, attention, norms, routers, shared experts); no routed expert weights
    lut.npy             uint8 ``[V, R]``: row v is the record of token v, R bytes (memory-mappable .npy)
    tokenizer files     copied from MODEL_DIR

Record of token v: for every layer l its routed outputs ``LUT_l[v, j] = FFN_j(RMSNorm_e(Embedding(v)))`` for
j < N, i.e. ``L x M`` values with ``M = N * D``, stored as

- ``quant="none"``: values ``[L, M]`` in ``dtype`` (float32 or float16): ``R = L * M * itemsize``;
- ``quant="int8"|"nf4"``: codes ``[L, C]`` then float16 block absmax ``[L, M_pad/64]`` (:mod:`expertcache.mole.quant`).

One token's rows for all layers are one contiguous record, so a token costs one read of R bytes (the routed
experts see only the embedding, so every layer's rows are known as soon as the token id is). The folder is built
next to its final name and renamed into place, so a reader never sees a half-written table.

Reading (:class:`LookupTable`), ``read_mode``:

- ``mmap``:  fancy indexing of a read-only ``np.memmap`` (page cache, kernel readahead);
- ``pread``: one ``os.pread`` of R bytes per distinct token id (page cache);
- ``flash``: like ``pread``, but the file is opened with ``POSIX_FADV_RANDOM`` (no readahead), its cached pages are
  dropped at open and the pages of every record are dropped (``POSIX_FADV_DONTNEED``) right after it is read, so
  every read goes to the storage device: flash-faithful;
- ``direct``: ``O_DIRECT`` reads of the page-aligned span of each record into an aligned buffer (bypasses the page
  cache; needs a file system that supports it).

``pread``/``flash``/``direct`` issue the reads of one lookup (the distinct ids of a forward) from ``io_threads``
threads (``os.pread`` releases the GIL), so a batch's reads overlap on the device like a queue depth > 1.

This is MoLE's own small reader: ``expertcache.offload.store.DiskTier`` (same semantics: ``flash`` here is its
``io='fadvise'``, ``direct`` its ``io='direct'``) appeared while this was written and reads *experts*
(``ExpertParts`` byte ranges of a checkpoint) into fast-tier slots; a table record is neither. Moving both onto one
byte-range reader is noted as follow-up work in docs/MOLE.md.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from expertcache.jsonsafe import load_path
from expertcache.mole import quant as Q

LUT_FILE = "lut.npy"
READ_MODES = ("mmap", "pread", "flash", "direct")
PAGE = 4096


@dataclass
class TableSpec:
    """What ``config.lookup_table`` holds: enough to parse records without the model."""

    vocab: int
    layers: int
    experts: int
    hidden: int
    quant: str = "none"
    dtype: str = "float16"  # quant="none" only
    block: int = Q.BLOCK
    file: str = LUT_FILE
    source: str = ""  # the training-form model folder it was exported from

    @property
    def m(self) -> int:
        """Values per token and layer (N * D)."""
        return self.experts * self.hidden

    @property
    def layer_bytes(self) -> int:
        if self.quant == "none":
            return self.m * np.dtype(self.dtype).itemsize
        return Q.code_bytes(self.quant, self.m) + Q.scale_bytes(self.m)

    @property
    def record_bytes(self) -> int:
        """R: bytes read per token (all layers)."""
        return self.layers * self.layer_bytes

    @property
    def table_bytes(self) -> int:
        return self.vocab * self.record_bytes

    def encode(self, y_ULM: np.ndarray) -> np.ndarray:
        """Routed outputs ``[U, L, M]`` float32 -> records ``[U, R]`` uint8."""
        u = len(y_ULM)
        if self.quant == "none":
            return np.ascontiguousarray(y_ULM.astype(self.dtype)).view(np.uint8).reshape(u, self.record_bytes)
        codes, absmax = Q.quantize(y_ULM, self.quant)
        return np.concatenate([codes.view(np.uint8).reshape(u, -1), absmax.view(np.uint8).reshape(u, -1)], axis=1)

    def decode(self, rec_UR: np.ndarray) -> np.ndarray:
        """Records ``[U, R]`` uint8 -> routed outputs ``[U, L, N, D]`` float32."""
        u, L = len(rec_UR), self.layers
        rec_UR = np.ascontiguousarray(rec_UR)
        if self.quant == "none":
            y = rec_UR.view(self.dtype).reshape(u, L, self.m).astype(np.float32)
        else:
            c = Q.code_bytes(self.quant, self.m)
            codes = rec_UR[:, : L * c].reshape(u, L, c)
            absmax = np.ascontiguousarray(rec_UR[:, L * c :]).view(np.float16).reshape(u, L, -1)
            y = Q.dequantize(codes, absmax, self.quant, self.m)
        return y.reshape(u, L, self.experts, self.hidden)


@dataclass
class ReadStats:
    """Reads served since open (or the last :meth:`LookupTable.reset_stats`). ``bytes`` counts record payload;
    ``device_bytes`` the whole pages a flash/direct read touches (what a page-granular device transfers)."""

    lookups: int = 0  # calls to lookup (one per forward)
    tokens: int = 0  # positions asked for, before de-duplication
    reads: int = 0  # records read (distinct ids per lookup)
    bytes: int = 0
    device_bytes: int = 0
    seconds: float = 0.0


class LookupTable:
    """Reader of ``lut.npy``: ``lookup(ids_U) -> [U, L, N, D]`` float32 (see the module docstring for modes)."""

    def __init__(self, path: Path, spec: TableSpec, read_mode: str = "mmap", io_threads: int = 8):
        if read_mode not in READ_MODES:
            raise ValueError(f"unknown read mode {read_mode!r}; choose one of {READ_MODES}")
        self.path, self.spec, self.read_mode = Path(path), spec, read_mode
        self.io_threads, self._pool = max(1, io_threads), None
        self.stats = ReadStats()
        try:
            arr = np.load(self.path, mmap_mode="r", allow_pickle=False)  # never unpickle a table file
        except (ValueError, OSError) as exc:
            raise ValueError(f"{self.path}: not a lookup table ({exc})") from None
        if arr.shape != (spec.vocab, spec.record_bytes) or arr.dtype != np.uint8:
            raise ValueError(f"{self.path}: shape {arr.shape} {arr.dtype}, expected ({spec.vocab}, "
                             f"{spec.record_bytes}) uint8 -- table and config disagree")
        self.offset = arr.offset  # byte offset of row 0 (after the .npy header)
        self._arr = arr if read_mode == "mmap" else None
        self._fd = None
        if read_mode in ("pread", "flash"):
            self._fd = os.open(self.path, os.O_RDONLY)
            if read_mode == "flash":
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        elif read_mode == "direct":
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                raise ValueError(f"O_DIRECT open of {self.path} failed ({exc}); use --read-mode flash") from exc
            span = -(-(spec.record_bytes + PAGE) // PAGE) * PAGE
            self._buf = mmap.mmap(-1, span)  # page-aligned anonymous buffer

    @classmethod
    def open(cls, table_dir: str | Path, read_mode: str = "mmap", io_threads: int = 8) -> "LookupTable":
        table_dir = Path(table_dir)
        cfg = load_path(table_dir / "config.json")
        if not cfg.get("lookup_table"):
            raise ValueError(f"{table_dir}/config.json has no lookup_table (not an exported MoLE table)")
        spec = TableSpec(**cfg["lookup_table"])
        return cls(table_dir / spec.file, spec, read_mode, io_threads)

    def close(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown()
            self._pool = None
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()

    def reset_stats(self) -> ReadStats:
        old, self.stats = self.stats, ReadStats()
        return old

    def _span(self, v: int) -> tuple[int, int]:
        """(page-aligned start, length) of the pages holding record ``v``."""
        off = self.offset + v * self.spec.record_bytes
        start = off // PAGE * PAGE
        end = -(-(off + self.spec.record_bytes) // PAGE) * PAGE
        return start, end - start

    def _read_one(self, v: int, out_R: np.ndarray) -> int:
        """Read record ``v`` into ``out_R``; returns the device bytes it cost (0 through the page cache)."""
        r = self.spec.record_bytes
        off = self.offset + v * r
        if self.read_mode == "direct":
            start, length = self._span(v)
            buf = self._buf if self.io_threads <= 1 else mmap.mmap(-1, length)  # page-aligned, one per read
            n = os.preadv(self._fd, [memoryview(buf)[:length]], start)
            if n < off - start + r:
                raise OSError(f"short O_DIRECT read of token {v}: {n} bytes")
            out_R[:] = np.frombuffer(buf, dtype=np.uint8, count=r, offset=off - start)
            return length
        data = os.pread(self._fd, r, off)
        if len(data) != r:
            raise OSError(f"short read of token {v}: {len(data)} of {r} bytes")
        out_R[:] = np.frombuffer(data, dtype=np.uint8)
        if self.read_mode == "flash":
            start, length = self._span(v)
            os.posix_fadvise(self._fd, start, length, os.POSIX_FADV_DONTNEED)
            return length
        return 0

    def read_records(self, ids: np.ndarray) -> np.ndarray:
        """Raw records ``[U, R]`` uint8 of token ids ``ids [U]`` (one read each, up to ``io_threads`` in flight;
        counted in :attr:`stats`)."""
        r = self.spec.record_bytes
        t0 = time.perf_counter()
        if self.read_mode == "mmap":
            out = np.asarray(self._arr[ids])
            device = 0
        else:
            out = np.empty((len(ids), r), dtype=np.uint8)
            vs = ids.tolist()
            if self.io_threads > 1 and len(vs) > 1:
                if self._pool is None:
                    from concurrent.futures import ThreadPoolExecutor

                    self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="mole-read")
                device = sum(self._pool.map(lambda i: self._read_one(vs[i], out[i]), range(len(vs))))
            else:
                device = sum(self._read_one(v, out[i]) for i, v in enumerate(vs))
        s = self.stats
        s.seconds += time.perf_counter() - t0
        s.reads += len(ids)
        s.bytes += len(ids) * r
        s.device_bytes += device
        return out

    def lookup(self, ids_U: torch.Tensor, positions: int | None = None) -> torch.Tensor:
        """Routed outputs ``[U, L, N, D]`` float32 of the distinct token ids ``ids_U``."""
        ids = ids_U.detach().cpu().numpy().astype(np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.spec.vocab):
            raise IndexError(f"token id out of range [0, {self.spec.vocab})")
        self.stats.lookups += 1
        self.stats.tokens += len(ids) if positions is None else positions
        return torch.from_numpy(self.spec.decode(self.read_records(ids)))
