"""Group-wise weight quantisation of experts: int8 (symmetric) and 4-bit (asymmetric), CPU and CUDA.

A small quantiser of our own rather than torchao/hqq/bitsandbytes: those either need a GPU (bitsandbytes),
pin torch versions, or quantise whole ``nn.Linear`` modules, whereas an offloaded expert is a flat byte
blob that must be read from disk with one ``pread`` and dequantised from a cache slot. The format is:

- groups of ``G`` consecutive weights along the input dimension (the last axis of each matrix; G divides it);
- ``int8``: ``q = round(w / s)`` in [-127, 127], ``s = max|w| / 127`` per group (fp16), ``w ≈ q · s``;
- ``int4``: ``q = round((w - m) / s)`` in [0, 15], ``m = min w``, ``s = (max w - min w) / 15`` per group
  (fp16 each), two values per byte (low nibble first), ``w ≈ q · s + m``.

One expert is packed as ``[gate_up q | gate_up scales | gate_up mins | down q | down scales | down mins]``
(mins only for int4), all in one uint8 blob; :class:`QuantLayout` gives the offsets. Dequantisation
returns ``gate_up`` [2F, D] and ``down`` [D, F] in the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["QUANT_MODES", "QuantLayout", "default_group", "quantize_matrix", "dequantize_matrix", "pack_expert", "unpack_expert"]

QUANT_MODES = ("int8", "int4")

#: the largest group size :func:`default_group` picks
MAX_DEFAULT_GROUP = 64


def default_group(d: int, f: int, largest: int = MAX_DEFAULT_GROUP) -> int:
    """The largest group size ≤ ``largest`` that divides both D and F (the quantised axes), e.g. 64 for
    OLMoE-1B-7B (D = 2048, F = 1024) and 8 for the shipped granular model (D = 144, F = 104)."""
    g = math.gcd(int(d), int(f))
    return max(x for x in range(1, min(g, largest) + 1) if g % x == 0)


@dataclass(frozen=True)
class QuantLayout:
    """Byte layout of one quantised expert (D hidden, F intermediate, G group size)."""

    mode: str
    d: int
    f: int
    group: int

    def __post_init__(self) -> None:
        if self.mode not in QUANT_MODES:
            raise ValueError(f"quantisation must be one of {QUANT_MODES}, got {self.mode!r}")
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"group size (--group) must be a whole number ≥ 1, got {self.group!r}")
        for name, dim in (("D", self.d), ("F", self.f)):
            if dim % self.group:
                raise ValueError(f"group size (--group) {self.group} does not divide {name}={dim}; use a divisor of "
                                 f"both D={self.d} and F={self.f} (default: {default_group(self.d, self.f)})")

    def _matrix_bytes(self, rows: int, cols: int) -> tuple[int, int, int]:
        n = rows * cols
        q = n if self.mode == "int8" else n // 2
        s = (n // self.group) * 2
        m = s if self.mode == "int4" else 0
        return q, s, m

    @property
    def shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return (2 * self.f, self.d), (self.d, self.f)

    @property
    def nbytes(self) -> int:
        return sum(sum(self._matrix_bytes(*shape)) for shape in self.shapes)

    def offsets(self) -> list[tuple[int, int, int, int]]:
        """Per matrix (gate_up, down): (q offset, scales offset, mins offset, end) in bytes."""
        out, at = [], 0
        for shape in self.shapes:
            q, s, m = self._matrix_bytes(*shape)
            out.append((at, at + q, at + q + s, at + q + s + m))
            at += q + s + m
        return out


def quantize_matrix(w_RC: torch.Tensor, mode: str, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q bytes uint8 [R·C or R·C/2], scales fp16 [R·C/G], mins fp16 [R·C/G] or None) of ``w_RC``."""
    w_NG = w_RC.float().reshape(-1, group)  # N groups × G
    if mode == "int8":
        s_N = (w_NG.abs().amax(dim=1) / 127).clamp(min=1e-12)
        s_N = s_N.half().float().clamp(min=2**-24)  # the stored (fp16) scale is the one applied
        q_NG = torch.round(w_NG / s_N[:, None]).clamp(-127, 127).to(torch.int8)
        return q_NG.reshape(-1).view(torch.uint8), s_N.half(), None
    lo_N, hi_N = w_NG.amin(dim=1), w_NG.amax(dim=1)
    s_N = ((hi_N - lo_N) / 15).half().float().clamp(min=2**-24)
    m_N = lo_N.half().float()
    q_NG = torch.round((w_NG - m_N[:, None]) / s_N[:, None]).clamp(0, 15).to(torch.uint8).reshape(-1)
    packed = q_NG[0::2] | (q_NG[1::2] << 4)
    return packed, s_N.half(), m_N.half()


def dequantize_matrix(blob_u8: torch.Tensor, off: tuple[int, int, int, int], shape: tuple[int, int], mode: str,
                      group: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``shape`` matrix in ``dtype`` from its bytes in ``blob_u8`` at offsets ``off`` (see QuantLayout)."""
    q0, s0, m0, end = off
    r, c = shape
    n = r * c
    scales_N = blob_u8[s0:m0 if mode == "int4" else end].view(torch.float16).to(dtype)
    if mode == "int8":
        q_NG = blob_u8[q0:s0].view(torch.int8).reshape(-1, group).to(dtype)
        return (q_NG * scales_N[:, None]).reshape(r, c)
    packed = blob_u8[q0:s0]
    q_N = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(n)
    mins_N = blob_u8[m0:end].view(torch.float16).to(dtype)
    return (q_N.reshape(-1, group).to(dtype) * scales_N[:, None] + mins_N[:, None]).reshape(r, c)


def pack_expert(gate_up_FD: torch.Tensor, down_DF: torch.Tensor, layout: QuantLayout) -> torch.Tensor:
    """One quantised expert as a uint8 blob of ``layout.nbytes`` bytes."""
    parts = []
    for w in (gate_up_FD, down_DF):
        q, s, m = quantize_matrix(w, layout.mode, layout.group)
        parts += [q, s.view(torch.uint8)] + ([m.view(torch.uint8)] if m is not None else [])
    blob = torch.cat(parts)
    assert blob.numel() == layout.nbytes, (blob.numel(), layout.nbytes)
    return blob


def unpack_expert(blob_u8: torch.Tensor, layout: QuantLayout, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [2F, D], down [D, F]) in ``dtype`` from one quantised expert blob."""
    (gu_off, down_off), (gu_shape, down_shape) = layout.offsets(), layout.shapes
    return (dequantize_matrix(blob_u8, gu_off, gu_shape, layout.mode, layout.group, dtype),
            dequantize_matrix(blob_u8, down_off, down_shape, layout.mode, layout.group, dtype))
