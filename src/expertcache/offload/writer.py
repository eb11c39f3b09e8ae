"""A streaming safetensors writer: tensors are produced one at a time, so a multi-GB checkpoint is written
without holding it in memory. The file is written to a temporary file beside it (``expertcache.outputs.temp_file``)
and renamed when complete (an interrupted write never leaves a file that looks valid; a failed one -- a full disk --
leaves no temporary file and names ``path``)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable, Iterable

import torch

from expertcache.offload.checkpoint import DTYPES
from expertcache.outputs import replace_file, temp_file
from expertcache.results import named

__all__ = ["write_safetensors"]

_NAMES = {v: k for k, v in DTYPES.items()}


def write_safetensors(path: str | os.PathLike,
                      tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]],
                      metadata: dict[str, str] | None = None) -> Path:
    """Write ``(key, dtype, shape, make)`` entries in the given order; ``make()`` returns the tensor (checked
    against dtype and shape). Returns the path."""
    path = Path(path)
    entries = list(tensors)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    at = 0
    for key, dtype, shape, _ in entries:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = temp_file(path)
    try:
        _write(tmp, raw, entries, path)
        replace_file(tmp, path)  # a device (/dev/null, /dev/stdout) is written, never replaced
    except BaseException as exc:
        tmp.unlink(missing_ok=True)  # a full disk leaves no temporary file behind
        if isinstance(exc, OSError):
            raise named(exc, path) from None
        raise
    return path


def _write(tmp: Path, raw: bytes, entries: list, path: Path) -> None:
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        from tqdm import tqdm

        bar = tqdm(entries, desc=f"write {path.name}", unit="tensor", disable=len(entries) < 1000, leave=False)
        for key, dtype, shape, make in bar:
            t = make()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{key}: produced {t.dtype} {tuple(t.shape)}, declared {dtype} {tuple(shape)}")
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        f.flush()
        os.fsync(f.fileno())
