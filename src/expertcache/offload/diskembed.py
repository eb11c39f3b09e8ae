"""The token embedding read from the checkpoint on demand: one ``pread`` of a row's bytes per distinct token id,
instead of a [V, D] matrix held in RAM.

A forward needs one row per token, so the embedding matrix (OLMoE: 50304 × 2048 bf16 = 196 MiB; 98 MiB as the
``--quant-dense`` int8 rows) is the largest part of the dense weights that a decode step touches least.
:class:`DiskEmbedding` holds nothing but the row's place in the safetensors file (file, data offset, row
bytes, stored dtype) and reads the rows of a forward's token ids with ``os.preadv`` (each distinct id once; the
kernel's page cache keeps recent rows, reclaimable under a memory cgroup's pressure, so no row cache of its own).

- **Exact**: a row is the checkpoint's own bytes, converted to the compute dtype as loading would
  (``Tensor.to``): the same values as the full matrix read whole (tests/test_disk_embedding.py), also where
  ``--quant-dense`` would otherwise have held it as int8 or int4 rows (it is then more accurate, not less).
- **Where**: :func:`use_disk_embedding` decides: a CPU run (the rows are read on the host), an untied embedding
  (a tied ``lm_head`` needs the whole matrix anyway: kept as before), no ``--compile`` (the captured step traces
  the embedding), and ``$EXPERTCACHE_EMBEDDING`` not ``ram`` (``disk``, the default, or ``ram``: the matrix held
  as before; anything else is refused in one line naming the variable).
- **The plan** counts it as 0 bytes (it holds none): :func:`expertcache.offload.qlinear.dense_bytes` skips it and
  the loader marks its key as used without reading it.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from expertcache.tensorfile import CheckpointError

__all__ = ["DiskEmbedding", "EMBEDDING_MODES", "embedding_mode", "use_disk_embedding"]

#: values of ``$EXPERTCACHE_EMBEDDING``
EMBEDDING_MODES = ("disk", "ram")


def embedding_mode() -> str:
    """``$EXPERTCACHE_EMBEDDING`` (``disk`` when unset or empty); ValueError naming it for another value."""
    v = os.environ.get("EXPERTCACHE_EMBEDDING", "").strip().lower() or "disk"
    if v not in EMBEDDING_MODES:
        raise ValueError(f"$EXPERTCACHE_EMBEDDING must be one of {', '.join(EMBEDDING_MODES)}, got "
                         f"{os.environ['EXPERTCACHE_EMBEDDING']!r}")
    return v


class DiskEmbedding(nn.Module):
    """``nn.Embedding`` whose [V, D] rows stay in ``file`` (row ``i``: ``row_bytes`` bytes at ``start + i ·
    row_bytes``, stored as ``stored``), returned in ``dtype``. No parameters, no buffers."""

    def __init__(self, file: str | os.PathLike, start: int, num_embeddings: int, embedding_dim: int,
                 stored: torch.dtype, dtype: torch.dtype, *, padding_idx: int | None = None, key: str = "") -> None:
        super().__init__()
        self.file, self.start, self.key = str(file), int(start), key
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.stored, self.dtype, self.padding_idx = stored, dtype, padding_idx
        self.row_bytes = self.embedding_dim * torch.empty((), dtype=stored).element_size()
        self._fd, self._pid = None, None

    @classmethod
    def from_checkpoint(cls, ckpt, key: str, dtype: torch.dtype, padding_idx: int | None = None) -> "DiskEmbedding":
        """The embedding stored under ``key`` of ``ckpt`` (a :class:`~expertcache.offload.checkpoint.Checkpoint`)."""
        e = ckpt.entries[key]
        if len(e.shape) != 2:
            raise ValueError(f"{key} has shape {list(e.shape)}, an embedding is [V, D]")
        return cls(e.file, e.start, e.shape[0], e.shape[1], e.dtype, dtype, padding_idx=padding_idx, key=key)

    def _fileno(self) -> int:
        if self._fd is None or self._pid != os.getpid():  # opened once a process (a fork opens its own)
            self._fd, self._pid = os.open(self.file, os.O_RDONLY), os.getpid()
        return self._fd

    def rows(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), D] in the stored dtype: row ``ids[j]`` of the file each, ``ids`` distinct and in range."""
        out = torch.empty(len(ids), self.embedding_dim, dtype=self.stored, device="cpu")  # host bytes, any default
        if not ids:
            return out
        view, rb, fd = memoryview(out.view(torch.uint8).numpy()).cast("B"), self.row_bytes, self._fileno()
        j = 0
        while j < len(ids):  # runs of consecutive ids: one read each
            k = j + 1
            while k < len(ids) and ids[k] == ids[k - 1] + 1:
                k += 1
            want = (k - j) * rb
            if os.preadv(fd, [view[j * rb:k * rb]], self.start + ids[j] * rb) != want:
                raise CheckpointError(f"{self.file}: short read of embedding rows {ids[j]}..{ids[k - 1]} (truncated file)")
            j = k
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to("cpu", torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id outside the embedding's [0, {self.num_embeddings})")
        if flat.numel() == 1:
            got = self.rows([int(flat[0])])
        else:
            uniq, inv = torch.unique(flat, sorted=True, return_inverse=True)
            got = self.rows(uniq.tolist())[inv]
        return got.to(self.dtype).view(*ids.shape, self.embedding_dim).to(ids.device)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None and self._pid == os.getpid():
            try:
                os.close(self._fd)
            except OSError:
                pass

    def __getstate__(self):  # a copy opens its own descriptor
        return dict(self.__dict__, _fd=None, _pid=None)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows read from {os.path.basename(self.file)} on demand"


def use_disk_embedding(model: nn.Module, ckpt, config, device: torch.device, dtype: torch.dtype, *,
                       compiled: bool = False) -> DiskEmbedding | None:
    """Replace ``model``'s input embedding (a skeleton's, before it is planned and loaded) by a
    :class:`DiskEmbedding` of its checkpoint key where that applies (see the module docstring); returns it, or
    None (nothing changed)."""
    if embedding_mode() != "disk" or torch.device(device).type != "cpu" or compiled:
        return None
    if bool(getattr(config, "tie_word_embeddings", False)):
        return None
    emb = model.get_input_embeddings()
    if type(emb) is not nn.Embedding:
        return None
    name = next(n for n, m in model.named_modules() if m is emb)
    key = next((k for k in ckpt.layout.disk_keys(f"{name}.weight") if k in ckpt.entries), None)
    if key is None or tuple(ckpt.entries[key].shape) != tuple(emb.weight.shape):
        return None  # the loader names the missing / misshapen tensor
    new = DiskEmbedding.from_checkpoint(ckpt, key, dtype, emb.padding_idx)
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return new
