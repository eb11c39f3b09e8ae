"""Block-wise absmax quantisation of lookup-table rows: NF4 (as in seed 002 / QLoRA) and int8. Pure numpy.

A row is the ``M = N*D`` values of one token at one layer. It is zero-padded to a multiple of ``BLOCK = 64`` and cut
into blocks; each block stores its absmax as float16 and one code per value:

- ``nf4``:  the index of the nearest of the 16 NormalFloat-4 levels to ``x / absmax``, two codes per byte
  (first value in the low nibble): 0.5 bytes + 2/64 bytes per value (4.25 bits);
- ``int8``: ``round(127 * x / absmax)`` as int8: 1 + 2/64 bytes per value (8.25 bits).

Quantisation uses the float16-rounded absmax, so ``dequantize(quantize(x))`` is within half a level of ``x``.
Shapes: ``x [..., M]`` float32 -> ``codes [..., C]`` uint8/int8, ``absmax [..., M_pad / 64]`` float16.
"""

from __future__ import annotations

import numpy as np

BLOCK = 64
QUANTS = ("none", "int8", "nf4")

# The NF4 levels of QLoRA (Dettmers et al. 2023, Appendix E), ascending, exactly 0 at index 7.
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=np.float32)
_NF4_MIDPOINTS = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2


def padded(m: int) -> int:
    """Row length ``m`` rounded up to whole blocks."""
    return -(-m // BLOCK) * BLOCK


def code_bytes(quant: str, m: int) -> int:
    """Bytes of the codes of one row of ``m`` values."""
    return {"nf4": padded(m) // 2, "int8": padded(m)}[quant]


def scale_bytes(m: int) -> int:
    """Bytes of the float16 absmax values of one row of ``m`` values."""
    return padded(m) // BLOCK * 2


def quantize(x: np.ndarray, quant: str) -> tuple[np.ndarray, np.ndarray]:
    """``x [..., M]`` -> (codes ``[..., code_bytes]`` uint8 (nf4) / int8, absmax ``[..., nb]`` float16).
    (Vectorised with torch for speed; the format is plain numpy.)"""
    import torch

    if quant not in QUANTS[1:]:
        raise ValueError(f"unknown quant {quant!r}; choose one of {QUANTS[1:]}")
    lead, m = x.shape[:-1], x.shape[-1]
    xt = torch.nn.functional.pad(torch.as_tensor(np.asarray(x, dtype=np.float32)), (0, padded(m) - m))
    xb = xt.reshape(*lead, -1, BLOCK)
    absmax = xb.abs().amax(dim=-1).to(torch.float16)
    scale = absmax.float().unsqueeze(-1)
    xn = (xb / torch.where(scale == 0, torch.ones_like(scale), scale)).clamp_(-1, 1)  # a zero block stays zero
    if quant == "int8":
        codes = torch.round(xn * 127).to(torch.int8).reshape(*lead, -1)
    else:
        q = torch.bucketize(xn, torch.from_numpy(_NF4_MIDPOINTS)).to(torch.uint8).reshape(*lead, -1)  # nearest
        codes = q[..., 0::2] | (q[..., 1::2] << 4)
    return codes.numpy(), absmax.numpy()


def dequantize(codes: np.ndarray, absmax: np.ndarray, quant: str, m: int) -> np.ndarray:
    """Inverse of :func:`quantize`: float32 ``[..., m]``."""
    lead = codes.shape[:-1]
    if quant == "int8":
        v = codes.view(np.int8).astype(np.float32) / 127
    elif quant == "nf4":
        c = codes.view(np.uint8)
        idx = np.stack([c & 0x0F, c >> 4], axis=-1).reshape(*lead, -1)
        v = NF4_LEVELS[idx]
    else:
        raise ValueError(f"unknown quant {quant!r}; choose one of {QUANTS[1:]}")
    v = v.reshape(*lead, -1, BLOCK) * absmax.astype(np.float32)[..., None]
    return v.reshape(*lead, -1)[..., :m]
