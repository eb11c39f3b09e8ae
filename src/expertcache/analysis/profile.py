"""The ERAS-biasing profile on disk: the activation frequency ``freq`` [L, E] (003 Sec. III-B, Biasing).

Two formats, chosen by the file suffix:

- ``.npy``  -- the bare float32 array [L, E] (``numpy.load`` reads it);
- ``.json`` -- ``{"freq": [[...] * E] * L, "num_layers": L, "num_experts": E, "top_k": K, "tokens": T,
  "model": ..., "source": ..., "definition": ...}``.

Rows are :func:`expertcache.analysis.activation_frequency` (each sums to 1). :func:`load_freq` reads either
format -- or a routing trace, from which it computes the profile -- and checks it against the [L, E] of
the trace it will be used with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from expertcache.analysis.profiling import activation_frequency
from expertcache.jsonsafe import load_path
from expertcache.results import atomic_write_bytes, save_npy

__all__ = ["PROFILE_SUFFIXES", "profile_of", "save_profile", "load_profile", "load_freq"]

PROFILE_SUFFIXES = (".npy", ".json")


def profile_of(trace) -> np.ndarray:
    """The [L, E] float32 ERAS profile of a :class:`~expertcache.trace.RoutingTrace` (its selections)."""
    return activation_frequency(trace.ids_TLK, trace.meta.num_experts)


def save_profile(path: str | os.PathLike, freq_LE: np.ndarray, *, meta: dict[str, Any] | None = None) -> Path:
    """Write ``freq_LE`` atomically as ``.npy`` (bare array) or ``.json`` (array + ``meta``)."""
    path = Path(path)
    freq_LE = np.asarray(freq_LE, dtype=np.float32)
    if freq_LE.ndim != 2:
        raise ValueError(f"a profile is [L, E], got shape {freq_LE.shape}")
    if path.suffix == ".npy":
        save_npy(path, freq_LE)
    elif path.suffix == ".json":
        doc = {**(meta or {}), "freq": freq_LE.tolist(), "num_layers": int(freq_LE.shape[0]),
               "num_experts": int(freq_LE.shape[1]),
               "definition": "freq[l][e] = share of layer l's selections going to expert e (rows sum to 1)"}
        atomic_write_bytes(path, (json.dumps(doc, sort_keys=True) + "\n").encode())
    else:
        raise ValueError(f"profile file must end in {' or '.join(PROFILE_SUFFIXES)}, got {path.name!r}")
    return path


def load_profile(path: str | os.PathLike) -> np.ndarray:
    """Read a ``.npy`` or ``.json`` profile as float32 [L, E]; ValueError if it is not a valid profile."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no profile file at {path}")
    try:
        if path.suffix == ".npy":
            freq = np.load(path, allow_pickle=False)
        elif path.suffix == ".json":
            doc = load_path(path)
            freq = np.asarray(doc["freq"], dtype=np.float64)
        else:
            raise ValueError(f"profile file must end in {' or '.join(PROFILE_SUFFIXES)}, got {path.name!r}")
    except (OSError, KeyError, TypeError, ValueError) as exc:  # ValueError: not UTF-8 / JSON, object arrays
        raise ValueError(f"{path} is not a readable activation profile: {exc}") from None
    freq = np.asarray(freq, dtype=np.float32)
    if freq.ndim != 2 or not np.isfinite(freq).all() or (freq < 0).any():
        raise ValueError(f"{path}: a profile is a finite non-negative [L, E] array, got shape {freq.shape}")
    return freq


def load_freq(path: str | os.PathLike, num_layers: int | None = None, num_experts: int | None = None) -> np.ndarray:
    """The ERAS profile [L, E] from a profile file (``.npy``/``.json``) or from a routing trace (any other
    suffix: the frequencies of its selections). With ``num_layers``/``num_experts`` given, a profile of
    another shape raises ValueError."""
    if Path(path).suffix in PROFILE_SUFFIXES:
        freq = load_profile(path)
    else:
        from expertcache.trace import RoutingTrace

        freq = profile_of(RoutingTrace.load(path))
    want = (num_layers if num_layers is not None else freq.shape[0],
            num_experts if num_experts is not None else freq.shape[1])
    if freq.shape != want:
        raise ValueError(f"activation profile {path} is [L, E] = {list(freq.shape)}, but the trace needs {list(want)}")
    return freq
