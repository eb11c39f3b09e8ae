"""Reading a safetensors checkpoint by key, without loading it: validated headers and expert byte ranges.

A safetensors file is ``[u64 little-endian header length N][N bytes JSON header][data]``; the header maps
each key to ``{"dtype", "shape", "data_offsets": [begin, end]}`` with offsets relative to the data section.
:func:`read_header` (:mod:`expertcache.tensorfile`, re-exported here) parses and checks that header itself (no
mmap of the file, no torch import of the data), so a single expert can be read with one ``pread`` of its byte range.

Loud on damage: a truncated file, a header that is not JSON, offsets outside the file or inconsistent with
dtype × shape, and a missing expert key all raise :class:`CheckpointError` (a ``ValueError``) naming the
file and key; nothing is ever read past what the header promises.

Expert layouts: each family's :class:`~expertcache.models.adapters.DiskLayout` (declared once, in its
``Family`` record; this module reads it as plain data and imports nothing of expertcache). Per MoE layer ``i``
and expert ``e`` (D hidden, F expert intermediate size):

- per-expert keys (what transformers 5.x ``save_pretrained`` writes): ``model.layers.{i}.{expert_block}.experts.
  {e}.{gate,up,down}.weight`` with the family's part names -- ``mlp`` / ``gate_proj, up_proj, down_proj`` for
  OLMoE, Qwen2/3-MoE, DeepSeek-V2/V3 (DeepSeek's ``shared_experts`` are not routed experts: non-expert weights,
  always resident), ``block_sparse_moe`` / ``w1, w3, w2`` for Mixtral and PhiMoE -- shaped [F, D], [F, D], [D, F];
- fused ``'linear'`` (transformers 5.x in-memory names, also accepted on disk): ``model.layers.{i}.mlp.experts.
  gate_up_proj`` [E, 2F, D] (gate rows first) and ``...experts.down_proj`` [E, D, F]; one expert is the slice
  ``[e]``, a contiguous byte range because E is the outer dimension;
- fused ``'interleaved'`` (GPT-OSS, what its checkpoints and transformers write): ``gate_up_proj`` [E, D, 2F]
  (gate and up *interleaved* along the last axis, used as ``x @ W``), ``gate_up_proj_bias`` [E, 2F],
  ``down_proj`` [E, F, D], ``down_proj_bias`` [E, D] -- four byte ranges per expert (``ExpertParts.layout ==
  'interleaved'``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

# the file format itself (headers, shard index, its error): one module at the bottom of the package, re-exported
from expertcache.tensorfile import DTYPES, CheckpointError, TensorEntry, index_shards, read_header

__all__ = ["CheckpointError", "TensorEntry", "read_header", "index_shards", "Checkpoint", "ExpertParts", "ByteRange",
           "DTYPES"]


@dataclass(frozen=True)
class ByteRange:
    """``nbytes`` bytes at absolute offset ``offset`` of ``file``, to be placed at ``dest`` (bytes) in a
    packed expert buffer."""

    file: Path
    offset: int
    nbytes: int
    dest: int


@dataclass(frozen=True)
class ExpertParts:
    """Where one expert's weights are and how they are packed into one contiguous buffer.

    reads: byte ranges to copy (file order); nbytes: packed size; dtype: storage dtype. With
    ``layout='linear'`` the packed buffer holds ``gate_up`` [2F, D] (gate rows, then up rows) at element
    offset ``gate_up_at`` and ``down`` [D, F] at ``down_at`` -- the layout of transformers' fused
    ``OlmoeExperts.gate_up_proj[e]`` / ``down_proj[e]``. With ``layout='interleaved'`` (GPT-OSS): ``gate_up``
    [D, 2F] (interleaved), ``down`` [F, D], and the biases [2F] at ``gate_up_bias_at`` and [D] at ``down_bias_at``.
    """

    reads: tuple[ByteRange, ...]
    nbytes: int
    dtype: torch.dtype
    d: int
    f: int
    gate_up_at: int
    down_at: int
    layout: str = "linear"
    gate_up_bias_at: int | None = None
    down_bias_at: int | None = None

    def tensors(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """name → (element offset in the packed buffer, shape) of every tensor of the expert."""
        d, f = self.d, self.f
        if self.layout == "blob":
            return {"blob": (0, (self.nbytes,))}
        if self.layout == "interleaved":
            return {"gate_up": (self.gate_up_at, (d, 2 * f)), "gate_up_bias": (self.gate_up_bias_at, (2 * f,)),
                    "down": (self.down_at, (f, d)), "down_bias": (self.down_bias_at, (d,))}
        return {"gate_up": (self.gate_up_at, (2 * f, d)), "down": (self.down_at, (d, f))}


class Checkpoint:
    """All tensors of a checkpoint folder (``model.safetensors``, or the shards named in
    ``model.safetensors.index.json``, or every ``*.safetensors``), by key; headers only.

    ``layout``: the family's ``DiskLayout`` (``family_for(config).disk``). ``expert(layer_id, e)`` locates one
    expert of decoder layer ``layer_id`` (see the module docstring); ``tensor(key)`` reads one tensor (used for
    the non-expert weights).
    """

    def __init__(self, folder: str | os.PathLike, layout, num_experts: int) -> None:
        self.folder = Path(folder)
        self.layout = layout
        self.num_experts = num_experts
        shards = index_shards(self.folder)
        if shards is not None:
            paths = shards
        elif (self.folder / "model.safetensors").is_file():
            paths = [self.folder / "model.safetensors"]
        else:
            paths = sorted(p for p in self.folder.glob("*.safetensors") if not p.name.startswith("expertcache-"))
        if not paths:
            raise FileNotFoundError(f"{self.folder}: no safetensors checkpoint (model.safetensors or shards)")
        self.entries: dict[str, TensorEntry] = {}
        for p in paths:
            if not p.is_file():
                raise CheckpointError(f"{p}: shard named in the index is missing")
            self.entries.update(read_header(p))
        self._parts: dict[tuple[int, int], ExpertParts] = {}

    # -- experts ---------------------------------------------------------------------------------

    def is_expert_key(self, key: str) -> bool:
        return ".experts." in key

    def expert(self, layer_id: int, e: int) -> ExpertParts:
        """The byte ranges and packed layout of expert ``e`` of decoder layer ``layer_id``; CheckpointError
        naming the key if it is missing or has the wrong shape."""
        cached = self._parts.get((layer_id, e))
        if cached is not None:
            return cached
        if not 0 <= e < self.num_experts:
            raise ValueError(f"expert id {e} out of range [0, {self.num_experts})")
        fused_gu, fused_down = self.layout.fused_keys(layer_id)
        per_expert = self.layout.expert_keys(layer_id, e)  # (gate, up, down), or None: fused only
        if self.layout.fused == "interleaved":
            parts = self._interleaved(layer_id, e, fused_gu, fused_down)
        elif per_expert is not None and any(k in self.entries for k in per_expert):
            parts = self._per_expert(layer_id, e, *per_expert)
        elif fused_gu in self.entries:
            parts = self._fused(layer_id, e, fused_gu, fused_down)
        else:
            named = f"{per_expert[0]!r} (nor fused {fused_gu!r})" if per_expert is not None else repr(fused_gu)
            raise CheckpointError(f"{self.folder}: missing expert key {named} for expert {e} of layer {layer_id}")
        self._parts[(layer_id, e)] = parts
        return parts

    def _need(self, key: str) -> TensorEntry:
        if key not in self.entries:
            raise CheckpointError(f"{self.folder}: missing expert key {key!r}")
        return self.entries[key]

    def _per_expert(self, layer_id, e, gate_k, up_k, down_k) -> ExpertParts:
        gate, up, down = self._need(gate_k), self._need(up_k), self._need(down_k)
        f, d = gate.shape
        for t, want in ((gate, (f, d)), (up, (f, d)), (down, (d, f))):
            if t.shape != want:
                raise CheckpointError(f"{t.file}: {t.key} has shape {list(t.shape)}, expected {list(want)}")
            if t.dtype != gate.dtype:
                raise CheckpointError(f"{t.file}: {t.key} is {t.dtype}, other parts of the expert {gate.dtype}")
        esize = gate.nbytes // (f * d)
        parts = sorted((gate, up, down), key=lambda t: (str(t.file), t.start))
        same_file = len({t.file for t in parts}) == 1
        contiguous = same_file and all(a.start + a.nbytes == b.start for a, b in zip(parts, parts[1:]))
        if contiguous and [t.key for t in parts].index(gate_k) + 1 == [t.key for t in parts].index(up_k):
            # one read in file order (transformers writes ``down, gate, up`` adjacent): gate|up stays fused
            at = {t.key: (t.start - parts[0].start) // esize for t in parts}
            reads = (ByteRange(parts[0].file, parts[0].start, sum(t.nbytes for t in parts), 0),)
            return ExpertParts(reads, sum(t.nbytes for t in parts), gate.dtype, d, f, at[gate_k], at[down_k])
        reads = (ByteRange(gate.file, gate.start, gate.nbytes, 0), ByteRange(up.file, up.start, up.nbytes, gate.nbytes),
                 ByteRange(down.file, down.start, down.nbytes, 2 * gate.nbytes))
        return ExpertParts(reads, 3 * gate.nbytes, gate.dtype, d, f, 0, 2 * f * d)

    def _fused(self, layer_id, e, gu_k, down_k) -> ExpertParts:
        gu, down = self._need(gu_k), self._need(down_k)
        if len(gu.shape) != 3 or gu.shape[0] != self.num_experts or gu.shape[1] % 2:
            raise CheckpointError(f"{gu.file}: {gu_k} has shape {list(gu.shape)}, expected [E={self.num_experts}, 2F, D]")
        _, f2, d = gu.shape
        f = f2 // 2
        if down.shape != (self.num_experts, d, f) or down.dtype != gu.dtype:
            raise CheckpointError(f"{down.file}: {down_k} has shape {list(down.shape)} {down.dtype}, expected "
                                  f"[{self.num_experts}, {d}, {f}] {gu.dtype}")
        gu_bytes, down_bytes = gu.nbytes // self.num_experts, down.nbytes // self.num_experts
        reads = (ByteRange(gu.file, gu.start + e * gu_bytes, gu_bytes, 0),
                 ByteRange(down.file, down.start + e * down_bytes, down_bytes, gu_bytes))
        return ExpertParts(reads, gu_bytes + down_bytes, gu.dtype, d, f, 0, 2 * f * d)

    def _interleaved(self, layer_id, e, gu_k, down_k) -> ExpertParts:
        gu, down = self._need(gu_k), self._need(down_k)
        gub, downb = self._need(gu_k + "_bias"), self._need(down_k + "_bias")
        n = self.num_experts
        if len(gu.shape) != 3 or gu.shape[0] != n or gu.shape[2] % 2:
            raise CheckpointError(f"{gu.file}: {gu_k} has shape {list(gu.shape)}, expected [E={n}, D, 2F]")
        _, d, f2 = gu.shape
        f = f2 // 2
        for t, want in ((down, (n, f, d)), (gub, (n, 2 * f)), (downb, (n, d))):
            if t.shape != want or t.dtype != gu.dtype:
                raise CheckpointError(f"{t.file}: {t.key} has shape {list(t.shape)} {t.dtype}, expected {list(want)} "
                                      f"{gu.dtype}")
        reads, at = [], 0
        for t in (gu, gub, down, downb):  # [e] of each: a contiguous range (E is the outer dimension)
            nb = t.nbytes // n
            reads.append(ByteRange(t.file, t.start + e * nb, nb, at))
            at += nb
        esize = torch.empty((), dtype=gu.dtype).element_size()
        offs = [r.dest // esize for r in reads]
        return ExpertParts(tuple(reads), at, gu.dtype, d, f, offs[0], offs[2], "interleaved", offs[1], offs[3])

    # -- other tensors ---------------------------------------------------------------------------

    def tensor(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Read one tensor (a fresh CPU tensor of its stored dtype and shape), or only ``rows`` = (a, b) of its
        first dimension (shape ``[b - a, *rest]``: one contiguous byte range, so a large matrix can be consumed
        a block of rows at a time without holding it whole)."""
        t = self.entries.get(key)
        if t is None:
            raise CheckpointError(f"{self.folder}: missing tensor {key!r}")
        shape, start, nbytes = tuple(t.shape), t.start, t.nbytes
        if rows is not None:
            a, b = rows
            if not shape or not 0 <= a <= b <= shape[0]:
                raise ValueError(f"rows {rows} outside {key!r} of shape {list(shape)}")
            row_bytes = t.nbytes // shape[0] if shape[0] else 0
            shape, start, nbytes = (b - a, *shape[1:]), t.start + a * row_bytes, (b - a) * row_bytes
        buf = bytearray(nbytes)
        with open(t.file, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [buf], start)
        if got != nbytes:
            raise CheckpointError(f"{t.file}: short read of {key!r} ({got} of {nbytes} bytes; truncated file)")
        if nbytes == 0:
            return torch.empty(shape, dtype=t.dtype)
        return torch.frombuffer(buf, dtype=t.dtype).reshape(shape)
