"""The on-disk routing-trace format.

A trace is one safetensors file holding, for T tokens (in time order; batched sequences are concatenated
one after another) and L MoE layers with E experts and K selected per token:

- ``logits``  [T, L, E] float16/float32 -- the router logits of every token at every MoE layer;
- ``ids``     [T, L, K] int16/int32     -- the selected expert ids, ordered by descending router weight
  (-1 = a dropped slot, pruning baseline only);
- ``weights`` [T, L, K] float32         -- optional: the combine weights of the selected experts;

and JSON metadata (:class:`TraceMeta`: model name, N, K, renormalisation, scoring, token count, source,
sequence starts ...). Writes are atomic (temporary file + ``os.replace``), so a crash never leaves a
half-written trace under the final name. ``load`` validates shapes, dtypes and metadata and fails with a
clear :class:`TraceError` for anything else, e.g. a truncated file.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np

from expertcache.jsonsafe import JSONError, loads
from expertcache.results import atomic_write_bytes

__all__ = ["TraceError", "TraceMeta", "RoutingTrace", "FORMAT_VERSION", "atomic_write_bytes"]

FORMAT_VERSION = 1
_META_KEY = "expertcache_trace"


class TraceError(ValueError):
    """A routing trace is malformed, truncated or inconsistent."""


@dataclass
class TraceMeta:
    """What a trace records. ``layer_ids`` are the model's decoder-layer indices of the L MoE layers."""

    model: str
    num_experts: int
    top_k: int
    renormalize: bool
    num_layers: int
    num_tokens: int = 0
    scoring: str = "softmax"
    source: str = ""
    layer_ids: list[int] = field(default_factory=list)
    sequence_starts: list[int] = field(default_factory=lambda: [0])
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TraceMeta":
        if not isinstance(d, dict):
            raise TraceError(f"trace metadata must be a JSON object, got a JSON {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        missing = {"model", "num_experts", "top_k", "renormalize", "num_layers"} - set(d)
        if missing:
            raise TraceError(f"trace metadata lacks {sorted(missing)}")
        meta = cls(**{k: v for k, v in d.items() if k in known})
        meta.check_types()
        return meta

    #: field -> (check, what it must be)
    _TYPES = {
        "model": (lambda v: isinstance(v, str), "a string"),
        "source": (lambda v: isinstance(v, str), "a string"),
        "scoring": (lambda v: v in ("softmax", "sigmoid"), '"softmax" or "sigmoid"'),
        "renormalize": (lambda v: isinstance(v, bool), "true or false"),
        **dict.fromkeys(("num_experts", "top_k", "num_layers", "num_tokens", "format_version"),
                        (lambda v: _is_int(v) and v >= 0, "an integer >= 0")),
        **dict.fromkeys(("layer_ids", "sequence_starts"),
                        (lambda v: isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v),
                         "a list of integers >= 0")),
        "extra": (lambda v: isinstance(v, dict), "a JSON object"),
    }

    def check_fits(self, num_experts: int, top_k: int, layer_ids, what: str) -> None:
        """ValueError naming ``what`` (``--calibrate-from t.trace``) unless this trace was recorded from a model
        of this shape: ``num_experts`` experts, ``top_k`` per token, MoE layers ``layer_ids`` -- a trace of
        another model (N = 8 given to N = 32) calibrates or profiles the wrong experts."""
        layer_ids = [int(i) for i in layer_ids]
        diff = []
        if self.num_experts != num_experts:
            diff.append(f"N = {self.num_experts} experts, the model has {num_experts}")
        if self.top_k != top_k:
            diff.append(f"K = {self.top_k} per token, the model routes {top_k}")
        if self.num_layers != len(layer_ids) or (self.layer_ids and list(self.layer_ids) != layer_ids):
            diff.append(f"{self.num_layers} MoE layers, the model has {len(layer_ids)}")
        if diff:
            raise ValueError(f"{what}: a trace of another model ({self.model}): {'; '.join(diff)}")

    def check_types(self) -> None:
        """TraceError naming the first field whose value has the wrong type (metadata read from a file)."""
        for name, (ok, what) in self._TYPES.items():
            v = getattr(self, name)
            if not ok(v):
                raise TraceError(f"trace metadata: {name} must be {what}, got {json.dumps(v, default=repr)}")


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


_ABS_PATH = re.compile(r"(/|~|[A-Za-z]:[\\/]|\\\\)[^\n]*")


def portable_metadata(obj: Any) -> Any:
    """``obj`` (JSON-like) with every absolute local path (``/...``, ``~...``, ``C:\\...``) replaced by its last
    component, so a written file says nothing about the machine that made it (e.g. a model folder
    ``/home/me/models/granular`` is stored as ``granular``)."""
    if isinstance(obj, dict):
        return {k: portable_metadata(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable_metadata(v) for v in obj]
    if isinstance(obj, str) and _ABS_PATH.fullmatch(obj):
        return PureWindowsPath(obj).name if "\\" in obj else PurePosixPath(obj).name
    return obj


@dataclass
class RoutingTrace:
    """Router logits and selections of T tokens at L MoE layers (see the module docstring)."""

    logits_TLE: np.ndarray
    ids_TLK: np.ndarray
    meta: TraceMeta
    weights_TLK: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.meta.num_tokens = int(self.logits_TLE.shape[0]) if self.logits_TLE.ndim == 3 else 0
        self.validate()

    # -- shape accessors
    @property
    def num_tokens(self) -> int:
        return int(self.ids_TLK.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.ids_TLK.shape[1])

    def validate(self) -> None:
        """Raise TraceError unless shapes, dtypes, id ranges and metadata agree."""
        m = self.meta
        z, ids = self.logits_TLE, self.ids_TLK
        if z.ndim != 3:
            raise TraceError(f"logits must be [T, L, E], got shape {z.shape}")
        if ids.ndim != 3:
            raise TraceError(f"ids must be [T, L, K], got shape {ids.shape}")
        if z.dtype not in (np.float16, np.float32):
            raise TraceError(f"logits must be float16 or float32, got {z.dtype}")
        if ids.dtype not in (np.int16, np.int32, np.int64):
            raise TraceError(f"ids must be int16/int32/int64, got {ids.dtype}")
        t, l, e = z.shape
        if ids.shape != (t, l, m.top_k):
            raise TraceError(f"ids shape {ids.shape} does not match logits {z.shape} and K={m.top_k}")
        if e != m.num_experts or l != m.num_layers:
            raise TraceError(f"logits shape {z.shape} does not match metadata N={m.num_experts}, L={m.num_layers}")
        if not 1 <= m.top_k <= m.num_experts:
            raise TraceError(f"metadata K={m.top_k} must be in [1, N={m.num_experts}]")
        if ids.size and (ids.min() < -1 or ids.max() >= e):
            raise TraceError(f"ids must be in [-1, {e}); found range [{ids.min()}, {ids.max()}]")
        if self.weights_TLK is not None and self.weights_TLK.shape != ids.shape:
            raise TraceError(f"weights shape {self.weights_TLK.shape} does not match ids {ids.shape}")
        if m.layer_ids and len(m.layer_ids) != l:
            raise TraceError(f"metadata lists {len(m.layer_ids)} layer ids for {l} layers")
        starts = m.sequence_starts or [0]
        if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or (t and starts[-1] >= t):
            raise TraceError(f"sequence_starts {starts[:8]}... must increase from 0 and stay below T={t}")
        if t and not (z < np.inf).all():  # NaN or +inf (-inf is a zero probability: allowed)
            bad = np.argwhere(~(z < np.inf))[0]
            what = "NaN" if np.isnan(z[tuple(bad)]) else "+inf"
            raise TraceError(f"logits contain {what} (token {bad[0]}, layer {bad[1]}, expert {bad[2]}): "
                             "router logits must be numbers below +inf")
        valid = ids >= 0
        if ids.size:
            srt = np.sort(np.where(valid, ids, -np.arange(1, ids.shape[-1] + 1)), axis=-1)
            if (srt[..., 1:] == srt[..., :-1]).any():
                raise TraceError("an expert id appears twice among one token's selections")

    def head(self, n: int) -> "RoutingTrace":
        """The first ``n`` tokens (with the sequences that start among them); the trace itself if it is shorter."""
        if n >= self.num_tokens:
            return self
        meta = replace(self.meta, sequence_starts=[s for s in self.meta.sequence_starts if s < n] or [0])
        w = None if self.weights_TLK is None else self.weights_TLK[:n]
        return RoutingTrace(self.logits_TLE[:n], self.ids_TLK[:n], meta, w)

    def sequences(self) -> list[tuple[int, int]]:
        """[start, end) token ranges of the sequences in the trace."""
        starts = list(self.meta.sequence_starts or [0])
        return list(zip(starts, starts[1:] + [self.num_tokens]))

    # -- I/O
    def save(self, path: str | os.PathLike, *, logits_dtype: str = "float16") -> Path:
        """Write the trace atomically. Logits are stored as float16 by default (halves the size)."""
        from safetensors.numpy import save

        tensors = {
            "logits": np.ascontiguousarray(self.logits_TLE.astype(logits_dtype)),
            "ids": np.ascontiguousarray(self.ids_TLK.astype(np.int16 if self.meta.num_experts < 32767 else np.int32)),
        }
        if self.weights_TLK is not None:
            tensors["weights"] = np.ascontiguousarray(self.weights_TLK.astype(np.float32))
        meta = json.dumps(portable_metadata(asdict(self.meta)), sort_keys=True)
        atomic_write_bytes(path, save(tensors, metadata={_META_KEY: meta}))
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RoutingTrace":
        """Read and validate a trace; TraceError (with the path) for anything malformed."""
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no trace file at {path}")
        if not path.is_file():  # a FIFO would block the read forever, a folder or device is no trace
            raise TraceError(f"{path}: not a regular file (a trace is a .safetensors file)")
        try:
            with safe_open(str(path), framework="numpy") as f:
                raw_meta = (f.metadata() or {}).get(_META_KEY)
                keys = set(f.keys())
                if raw_meta is None:
                    raise TraceError(f"{path} is a safetensors file but not an expertcache trace (no metadata)")
                if not {"logits", "ids"} <= keys:
                    raise TraceError(f"{path}: trace lacks tensors {sorted({'logits', 'ids'} - keys)}")
                logits = f.get_tensor("logits")
                ids = f.get_tensor("ids")
                weights = f.get_tensor("weights") if "weights" in keys else None
        except TraceError:
            raise
        except Exception as exc:  # safetensors raises its own error types for truncation/corruption
            raise TraceError(f"{path} is not a readable trace (truncated or corrupt?): {exc}") from None
        try:
            meta = TraceMeta.from_dict(loads(raw_meta, what="trace metadata"))
        except (JSONError, TypeError) as exc:
            raise TraceError(f"{path}: {exc}") from None
        except TraceError as exc:
            raise TraceError(f"{path}: {exc}") from None
        if meta.format_version > FORMAT_VERSION:
            raise TraceError(f"{path}: trace format {meta.format_version} is newer than this expertcache "
                             f"({FORMAT_VERSION}); upgrade expertcache")
        try:
            trace = cls(logits_TLE=logits, ids_TLK=ids, meta=meta, weights_TLK=weights)
        except TraceError as exc:
            raise TraceError(f"{path}: {exc}") from None
        if trace.num_tokens == 0:  # every rate would read 0 %: nothing was recorded
            raise TraceError(f"{path}: the trace holds 0 tokens (nothing to simulate or analyse)")
        if not (np.asarray(trace.ids_TLK) >= 0).any():  # every selection dropped (-1): rates of 0 accesses
            raise TraceError(f"{path}: the trace selects no expert ({trace.num_tokens} tokens, every selection -1): "
                             "no accesses to simulate or analyse")
        return trace
