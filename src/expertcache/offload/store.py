"""The slow tiers of the expert store: a disk tier (flash-faithful or page-cached) and a host-RAM tier.

An *expert source* says which bytes make up one expert (:class:`NativeSource`: the slices of the model's
own safetensors files; :class:`QuantSource`: one blob of a quantised sidecar file written by
:func:`quantize_checkpoint`). A *tier* copies those bytes into a destination buffer (a fast-tier slot, or a
pinned staging buffer on the way to a GPU) and counts what it moved:

- :class:`DiskTier` ``io='direct'``: ``O_DIRECT`` reads of the 4 KiB-aligned span around each range into an
  aligned bounce buffer (every miss reads the device; the page cache is bypassed -- the phone/flash setting
  of 001). ``io='fadvise'``: ``posix_fadvise(DONTNEED)`` on the range, then a buffered ``pread`` (the page
  cache is dropped before each read, so it too reads the device). ``io='cached'``: plain ``pread`` (a warm
  page cache makes this a RAM copy). ``bytes_read`` counts the bytes requested from the device (the aligned
  span for ``direct``).
- :class:`HostTier`: every expert of every MoE layer read once into host RAM (page-locked for a CUDA
  runtime, in power-of-two blocks torch's pinned allocator does not round: :func:`pinned_blocks`), one
  contiguous row per expert; a miss is a memory copy (the PCIe setting of 003/004).

Asynchronous use: :meth:`DiskTier.read` / :meth:`HostTier.read` copy one expert into its *slot* following a
:class:`Placement` (:func:`place_expert`) and are safe to call from several reader threads at once (see
:mod:`expertcache.offload.ioqueue`); ``os.preadv`` releases the GIL, so reads overlap with compute. With
``io='direct'`` the placement puts each 4 KiB-aligned span straight into the (page-aligned) slot, so the
bytes are read **in place** -- no bounce buffer, no copy -- whenever every weight matrix lies inside one
byte range (the usual case: one expert = one contiguous range, or one range per fused tensor); otherwise
the span goes through a per-thread bounce buffer and is copied to its packed position.

Tiers know nothing about caches or routing.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from expertcache.offload.binding import (SOURCE_KEY, check_bound, check_not_newer, check_sidecar_place, mark_verified,
                                         source_digest, was_verified)
from expertcache.offload.checkpoint import ByteRange, Checkpoint, CheckpointError, ExpertParts, read_header
# the byte layout of a slot (re-exported: ALIGN, Placement, place_expert)
from expertcache.offload.layout import ALIGN, Placement, expert_views, place_expert
from expertcache.offload.quant import FORMAT_VERSION, QuantLayout, default_group, expert_layout_kernel, pack_expert
from expertcache.offload.writer import write_safetensors
from expertcache.tensorfile import read_metadata

__all__ = ["IO_MODES", "TIERS", "NativeSource", "QuantSource", "DiskTier", "HostTier", "TierStats", "Placement",
           "place_expert", "pinned_blocks", "quantize_checkpoint", "quant_sidecar_path", "direct_io_supported",
           "ALIGN", "verify_quant_sidecar", "CHECKSUM_KEY", "check_sidecar_layout", "quant_layout_for"]

#: tensor of a quantised sidecar holding one blake2b-128 digest per expert blob (uint8 [n, 16], rows in the
#: order the blobs are stored in the file)
CHECKSUM_KEY = "expertcache.checksums"
_DIGEST = 16
_VERIFIED: set[tuple] = set()  # binding.file_stamps of the sidecars verified by this process


def _digest(data) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST).digest()


def _mark_verified(path: Path, *, across_processes: bool = True) -> None:
    """``path``'s checksums hold: remembered in this process and (``across_processes``: they were checked by
    reading the file back) for later processes (:func:`~expertcache.offload.binding.mark_verified`)."""
    mark_verified(path, "sidecar-verified", _VERIFIED, across_processes=across_processes)


def verify_quant_sidecar(path: str | os.PathLike, entries: dict | None = None) -> None:
    """Check every expert blob of a quantised sidecar against its stored blake2b digest (one sequential read
    of the file; remembered for an unchanged file, in the process and across processes through
    :func:`~expertcache.offload.binding.remember`, keyed by the file's stamps incl. ctime, so that a second start
    does not read the whole sidecar again: 2.0 s of an 8-layer OLMoE-1B-7B shape's q4 start). CheckpointError naming the file (and the
    first damaged expert) on a mismatch, or when the file has no checksums (written by an older
    expertcache)."""
    path = Path(path)
    if was_verified(path, "sidecar-verified", _VERIFIED):
        return
    entries = read_header(path) if entries is None else entries
    ck = entries.get(CHECKSUM_KEY)
    if ck is None:
        raise CheckpointError(f"{path}: quantised experts without checksums (written by an older expertcache); "
                              "delete the file and it is rebuilt from the checkpoint")
    keys = sorted((k for k in entries if k.endswith(".qblob")), key=lambda k: entries[k].start)
    if tuple(ck.shape) != (len(keys), _DIGEST) or ck.dtype != torch.uint8:
        raise CheckpointError(f"{path}: checksum table {tuple(ck.shape)} does not match {len(keys)} experts")
    with open(path, "rb") as f:
        f.seek(ck.start)
        table = f.read(ck.nbytes)
        for i, key in enumerate(keys):
            t = entries[key]
            f.seek(t.start)
            if _digest(f.read(t.nbytes)) != table[i * _DIGEST:(i + 1) * _DIGEST]:
                raise CheckpointError(f"{path}: {key} fails its checksum (the file is damaged); delete the file and "
                                      "it is rebuilt from the checkpoint")
    _mark_verified(path)

IO_MODES = ("direct", "fadvise", "cached")
TIERS = ("disk", "host")


class NativeSource:
    """Experts as stored in the checkpoint: ``parts(layer_id, e)`` (ExpertParts) in the storage dtype."""

    quant: QuantLayout | None = None

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint

    def parts(self, layer_id: int, e: int) -> ExpertParts:
        return self.checkpoint.expert(layer_id, e)


def quant_sidecar_path(folder: str | os.PathLike, layout: QuantLayout) -> Path:
    """The sidecar's file name for ``layout``: format, mode, group (int4), kernel layout and scale dtype."""
    group = f"-g{layout.group}" + ("" if layout.optimize == "minmax" else f"-{layout.optimize}") if layout.mode == "int4" else ""
    dtype = str(layout.dtype).replace("torch.", "")
    return Path(folder) / f"expertcache-experts-v{FORMAT_VERSION}-{layout.mode}{group}-{layout.kernel}-{dtype}.safetensors"


def _layout_meta(layout: QuantLayout) -> dict[str, str]:
    return {"format_version": str(FORMAT_VERSION), "mode": layout.mode, "group": str(layout.group),
            "kernel": layout.kernel, "dtype": str(layout.dtype).replace("torch.", ""), "d": str(layout.d),
            "f": str(layout.f), **({"optimize": layout.optimize} if layout.optimize != "minmax" else {})}


def check_sidecar_layout(path: str | os.PathLike, layout: QuantLayout) -> None:
    """CheckpointError naming the file unless its metadata says it holds ``layout``'s packed experts (an
    older format, or another kernel layout, group or dtype: it is not read, it is rebuilt or refused)."""
    path = Path(path)
    meta = read_metadata(path)
    want = _layout_meta(layout)
    check_not_newer(path, meta)
    if meta.get("format_version") != want["format_version"]:
        raise CheckpointError(f"{path}: quantised experts in format {meta.get('format_version', 1)} (an older "
                              f"expertcache, dequantised per use), this one reads format {FORMAT_VERSION} (the fused "
                              "kernels' layout); delete the file and it is rebuilt from the checkpoint")
    diff = [f"{k} {meta.get(k)!r} (want {v!r})" for k, v in want.items() if meta.get(k) != v]
    if diff:
        raise CheckpointError(f"{path}: quantised experts for another layout: {', '.join(diff)}; delete the file "
                              "and it is rebuilt from the checkpoint")


class QuantSource:
    """Quantised experts of a sidecar file: key ``model.layers.{i}.experts.{e}.qblob`` (uint8 blob in the fused
    kernels' layout, see :mod:`expertcache.offload.quant`), one read per expert, nothing done to it after the
    read. The file's metadata must name ``layout`` (:func:`check_sidecar_layout`) and its blobs verify against
    its checksums when it is opened (:func:`verify_quant_sidecar`)."""

    def __init__(self, path: str | os.PathLike, layout: QuantLayout) -> None:
        self.path = Path(path)
        self.quant = layout
        self.entries = read_header(self.path)
        check_sidecar_layout(self.path, layout)
        verify_quant_sidecar(self.path, self.entries)
        self._parts: dict[tuple[int, int], ExpertParts] = {}

    def parts(self, layer_id: int, e: int) -> ExpertParts:
        got = self._parts.get((layer_id, e))
        if got is not None:
            return got
        key = f"model.layers.{layer_id}.experts.{e}.qblob"
        t = self.entries.get(key)
        if t is None:
            raise CheckpointError(f"{self.path}: missing expert key {key!r}")
        if t.nbytes != self.quant.nbytes or t.dtype != torch.uint8:
            raise CheckpointError(f"{self.path}: {key} has {t.nbytes} bytes {t.dtype}, expected "
                                  f"{self.quant.nbytes} uint8 for {self.quant}")
        got = ExpertParts((ByteRange(t.file, t.start, t.nbytes, 0),), t.nbytes, torch.uint8, self.quant.d,
                          self.quant.f, 0, 0, "blob")
        self._parts[(layer_id, e)] = got
        return got


def quant_layout_for(checkpoint: Checkpoint, layer_id: int, mode: str, group: int | None = None,
                     dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                     optimize: str = "minmax") -> QuantLayout:
    """The layout of ``checkpoint``'s experts quantised to ``mode`` for compute in ``dtype`` (None: the experts'
    storage dtype) on ``device``; ``group`` None = :func:`~expertcache.offload.quant.default_group`."""
    p0 = checkpoint.expert(layer_id, 0)
    if p0.layout != "linear":
        raise ValueError(f"--quant needs gate_up/down experts (the 'linear' layout), not {p0.layout!r}")
    group = default_group(p0.d, p0.f) if group is None else group
    return QuantLayout(mode, p0.d, p0.f, group, dtype or p0.dtype, expert_layout_kernel(mode, device),
                       optimize if mode == "int4" else "minmax")


def quantize_checkpoint(checkpoint: Checkpoint, layer_ids: list[int], mode: str | QuantLayout,
                        group: int | None = None, out: str | os.PathLike | None = None) -> Path:
    """Write the quantised sidecar of every expert of ``layer_ids``, each expert packed once in the fused
    kernels' layout (``mode``: a :class:`QuantLayout`, or 'int8'/'int4' for :func:`quant_layout_for`'s
    defaults), streaming: one expert read, packed and written at a time (memory: one expert), with a blake2b
    digest per expert (tensor ``CHECKSUM_KEY``) and the layout in the metadata. Returns its path (default:
    next to the checkpoint). Skips the work if a sidecar of this layout exists whose checksums verify;
    rebuilds a damaged one or one of an older format (a note on stderr)."""
    layout = mode if isinstance(mode, QuantLayout) else quant_layout_for(checkpoint, layer_ids[0], mode, group)
    path = Path(out) if out is not None else quant_sidecar_path(checkpoint.folder, layout)
    check_sidecar_place(path)  # a folder in its place: named, never replaced
    if path.is_file():
        try:
            entries = read_header(path)
            check_sidecar_layout(path, layout)
            if len(entries) == len(layer_ids) * checkpoint.num_experts + 1:
                verify_quant_sidecar(path, entries)
                check_bound(path, checkpoint, layer_ids)  # made from this checkpoint (offload.binding)
                return path
        except CheckpointError as exc:
            print(f"expertcache: {exc}; rebuilding it", file=sys.stderr)
    tier = DiskTier("cached")

    def make(layer_id: int, e: int):
        def f():
            parts = checkpoint.expert(layer_id, e)
            buf = torch.empty(parts.nbytes, dtype=torch.uint8)
            tier.fetch(parts, buf)  # packed: gate_up [2F, D] and down [D, F] as expert_views reads them
            blob = pack_expert(*expert_views(buf, parts, place_expert(parts, "cached"), parts.dtype), layout)
            digests.append(_digest(blob.numpy()))
            return blob
        return f

    digests: list[bytes] = []
    entries = [(f"model.layers.{i}.experts.{e}.qblob", torch.uint8, (layout.nbytes,), make(i, e))
               for i in layer_ids for e in range(checkpoint.num_experts)]
    n = len(entries)
    entries.append((CHECKSUM_KEY, torch.uint8, (n, _DIGEST),  # written last: every digest is known by then
                    lambda: torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.uint8).reshape(n, _DIGEST)))
    meta = {"format": "pt", "expertcache": "quantized-experts", **_layout_meta(layout),
            SOURCE_KEY: source_digest(checkpoint, layer_ids),
            "checksum": f"blake2b-{8 * _DIGEST} per expert in {CHECKSUM_KEY}"}
    out_path = write_safetensors(path, entries, meta)
    _mark_verified(out_path, across_processes=False)  # written, not read back: the next process checks it once
    return out_path


@dataclass
class TierStats:
    """Bytes and time spent moving experts out of a tier. ``seconds`` sums the duration of every read (with
    parallel readers this exceeds wall time: it is device-busy time, not waiting time). Updated by reader
    threads under a lock (:meth:`add`)."""

    loads: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, nbytes: int, seconds: float, loads: int = 1) -> None:
        with self._lock:
            self.loads += loads
            self.bytes_read += nbytes
            self.seconds += seconds


def direct_io_supported(path: str | os.PathLike) -> bool:
    """Whether ``path``'s filesystem accepts O_DIRECT opens (tmpfs and some overlays do not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


@dataclass
class DiskTier:
    """Reads experts from the checkpoint files on every request (see the module docstring for ``io``)."""

    io: str = "direct"
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        if self.io not in IO_MODES:
            raise ValueError(f"io must be one of {IO_MODES}, got {self.io!r}")
        self._fds: dict[Path, int] = {}
        self._open_lock = threading.Lock()
        self._local = threading.local()  # per reader thread: its bounce buffer

    def fd(self, file: Path) -> int:
        """The read descriptor of ``file`` (opened once, with O_DIRECT in ``direct`` io; an unsupported O_DIRECT
        is refused here, so the runtime opens every file at start)."""
        fd = self._fds.get(file)
        if fd is not None:
            return fd
        with self._open_lock:
            fd = self._fds.get(file)
            if fd is None:
                flags = os.O_RDONLY | (os.O_DIRECT if self.io == "direct" else 0)
                try:
                    fd = os.open(file, flags)
                except OSError as exc:
                    if self.io == "direct":
                        raise OSError(f"{file}: O_DIRECT is not supported on this filesystem ({exc}); use "
                                      "--io fadvise (drops the page cache before each read) instead") from None
                    raise
                self._fds[file] = fd
            return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    def fetch(self, parts: ExpertParts, dest_u8: torch.Tensor) -> int:
        """Copy the expert's bytes into ``dest_u8`` (CPU uint8, at least ``parts.nbytes``) in the packed layout
        (through a bounce buffer with ``direct``). Returns the bytes read from the device."""
        return self.read(parts, place_expert(parts, self.io, packed=True), dest_u8)

    def read(self, parts: ExpertParts, placement: Placement, dest_u8: torch.Tensor) -> int:
        """Read one expert into its slot ``dest_u8`` (CPU uint8, page-aligned for ``direct``) following
        ``placement``; thread-safe (called by reader threads). Returns the bytes read from the device.
        A failed or short read raises OSError / CheckpointError naming the file."""
        t0 = time.perf_counter()
        moved = 0
        view = memoryview(dest_u8.numpy())
        if placement.bounce:
            bounce = self._thread_bounce(max(n for _, _, n, _, _ in placement.spans))
        for i, (file, offset, length, at, needed) in enumerate(placement.spans):
            target = memoryview(bounce)[:length] if placement.bounce else view[at:at + length]
            got = self._pread(file, offset, target, needed)
            if placement.bounce:
                r = parts.reads[i]
                skip = r.offset - offset
                dest_u8[r.dest:r.dest + r.nbytes].copy_(
                    torch.frombuffer(bounce, dtype=torch.uint8, count=skip + r.nbytes)[skip:])
            moved += got
        self.stats.add(moved, time.perf_counter() - t0)
        return moved

    def _pread(self, file: Path, offset: int, target: memoryview, needed: int) -> int:
        """One ``preadv`` of ``target.nbytes`` bytes at ``offset`` of ``file`` (page cache dropped first with
        ``io='fadvise'``); fewer than ``needed`` bytes → CheckpointError, an OS error → OSError naming the file."""
        fd, length = self.fd(file), target.nbytes
        if self.io == "fadvise":
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        try:
            got = os.preadv(fd, [target], offset)
        except OSError as exc:
            raise OSError(exc.errno, f"reading expert bytes [{offset}, {offset + length}) failed "
                                     f"({exc.strerror})", str(file)) from None
        if got < needed:
            raise CheckpointError(f"{file}: short read at byte {offset} ({got} of {needed} bytes; truncated file?)")
        return got

    def _thread_bounce(self, nbytes: int) -> mmap.mmap:
        buf = getattr(self._local, "bounce", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.bounce = mmap.mmap(-1, -(-nbytes // ALIGN) * ALIGN)
        return buf


#: the smallest block a pinned host tier asks for (and at least 32 rows' bytes, rounded to a power of two)
PINNED_BLOCK = 1 << 28


def pinned_blocks(row_bytes: int, rows: int, block: int = PINNED_BLOCK) -> list[tuple[int, int]]:
    """How to hold ``rows`` rows of ``row_bytes`` in page-locked memory without paying torch's rounding:
    [(block bytes, rows in it)], every block a power of two (torch's pinned allocator rounds each request up
    to one: a block asked at that size costs what it holds). Full blocks are the smallest power of two ≥
    max(``block``, 32 rows) -- each wastes less than one row, < 1/32 of it --, the rest is split into halving
    powers of two (each wastes less than a row) and a last row alone (< 2× its bytes). Pure arithmetic."""
    if row_bytes <= 0 or rows < 0:
        raise ValueError(f"row_bytes must be > 0 and rows >= 0, got {row_bytes}, {rows}")
    big = 1 << (max(block, 32 * row_bytes) - 1).bit_length()
    per = big // row_bytes
    out, left = [], rows
    while left >= per:
        out.append((big, per))
        left -= per
    while left:
        size = left * row_bytes
        p = 1 << (size.bit_length() - 1)  # the largest power of two ≤ what is left
        if p < row_bytes:  # one row left, less than twice a smaller power of two: its own rounded block
            out.append((1 << (size - 1).bit_length(), left))
            break
        out.append((p, p // row_bytes))
        left -= p // row_bytes
    return out


class HostTier:
    """Every expert of ``layer_ids`` in host RAM: ``rows[layer_id][e]`` its bytes (uint8). ``pin`` (a CUDA
    runtime): in page-locked blocks laid out by :func:`pinned_blocks` (``pinned_bytes`` ≤ 1.05 × the experts'
    bytes on every shipped model, where one page-locked tensor per layer paid up to 2×); else one ordinary
    [E, nbytes] tensor per layer and nothing pinned. Loaded once at construction from ``source`` with
    buffered reads."""

    def __init__(self, source, layer_ids: list[int], num_experts: int, *, pin: bool = False) -> None:
        disk = DiskTier("cached")
        self.stats = TierStats()
        self.rows: dict[int, torch.Tensor | list[torch.Tensor]] = {}
        self.pinned_bytes = 0
        sizes = {i: source.parts(i, 0).nbytes for i in layer_ids}
        if pin and len(set(sizes.values())) == 1:
            nbytes = next(iter(sizes.values()))
            views = []
            for size, n in pinned_blocks(nbytes, len(layer_ids) * num_experts):
                blk = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                self.pinned_bytes += size
                views += [blk[r * nbytes:(r + 1) * nbytes] for r in range(n)]
            for j, i in enumerate(layer_ids):
                self.rows[i] = views[j * num_experts:(j + 1) * num_experts]
        else:
            for i in layer_ids:
                self.rows[i] = torch.empty(num_experts, sizes[i], dtype=torch.uint8, pin_memory=pin)
                self.pinned_bytes += self.rows[i].numel() if pin else 0
        for i in layer_ids:
            for e in range(num_experts):
                disk.fetch(source.parts(i, e), self.rows[i][e])
        disk.close()
        self.nbytes = sum(num_experts * n for n in sizes.values())

    def read(self, layer_id: int, e: int, dest_u8: torch.Tensor) -> int:
        """Copy expert ``e`` of ``layer_id`` into its slot (packed layout); thread-safe."""
        t0 = time.perf_counter()
        row = self.rows[layer_id][e]
        dest_u8[:row.numel()].copy_(row)
        self.stats.add(row.numel(), time.perf_counter() - t0)
        return row.numel()
