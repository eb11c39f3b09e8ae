"""FBGEMM's int8 × int8 product (``quantized.linear_dynamic``) on a weight given as int8 codes and a scale per
output channel, packed a block of rows at a time.

:func:`fbgemm_prepack` hands FBGEMM the codes themselves (a ``torch.qint8`` per-channel tensor made around them by
``torch._make_per_channel_quantized_tensor``: no float copy of the matrix, no re-quantisation), in blocks of
:data:`FBGEMM_ROWS` output channels, one ``linear_prepack`` each: the transient of packing is one block's copies
(:data:`FINISH_TRANSIENT`), not the matrix's. Packing the whole matrix from a float32 product ``codes · s`` (the
earlier path) held 8 bytes per element at its peak: 786 MiB for a 50k-vocabulary × 2048 ``lm_head``, which no term
of the memory plan counted (an OOM kill under ``--memory auto`` in a cgroup). :func:`fbgemm_linear` runs every block
and concatenates their outputs: each output column depends only on its own row of codes and scale and on the
activation's quantisation (one per call, shared by all blocks), so the result equals the unblocked product's.
"""

from __future__ import annotations

import warnings

import torch

from expertcache.offload.budget import release_free_heap

__all__ = ["FBGEMM_ROWS", "FINISH_TRANSIENT", "fbgemm_prepack", "fbgemm_linear"]

#: output channels per ``linear_prepack`` call (a list of packed blocks; the forward concatenates their outputs).
#: FBGEMM's prepack costs superlinearly in the block's rows at K = 2048 (AMD EPYC, one thread: 16.5 ns an element
#: at 2048 rows, 26 at 3072, 41.5 at 4096): 2048-row blocks pack a 50304 × 2048 ``lm_head`` in 1.7 s against 4.5 s
#: (the start's largest cost after the imports), and its one-token product was not slower (20.0 vs 26.2 ms, noisy)
FBGEMM_ROWS = 2048

#: copies of one block's int8 codes held at the peak of :func:`fbgemm_prepack` beside the matrix's codes and the
#: blocks packed so far: the contiguous slice of the codes, FBGEMM's packed block, its scratch while packing
#: (measured 2.0-2.3 block-sized copies for 8192 × 1000 and 50304 × 2048 with 4096-row blocks; bound 4)
FINISH_TRANSIENT = 4


def fbgemm_prepack(codes: torch.Tensor, scales: torch.Tensor, *, rows: int = FBGEMM_ROWS) -> list:
    """FBGEMM's packed weights of the int8 matrix ``codes`` [N, K] (any strides; int8) with ``scales`` [N] (any
    float dtype) per output channel, zero point 0: ``W = codes · scales[:, None]``; one packed object per block of
    ``rows`` rows, in order."""
    if codes.dtype != torch.int8 or codes.dim() != 2 or scales.shape != codes.shape[:1]:
        raise ValueError(f"fbgemm_prepack takes int8 codes [N, K] and scales [N], got {codes.dtype} "
                         f"{list(codes.shape)} and {list(scales.shape)}")
    if rows <= 0:
        raise ValueError(f"rows must be positive, got {rows}")
    out = []
    with warnings.catch_warnings():  # torch deprecates quantized tensors; FBGEMM's op still takes one
        warnings.simplefilter("ignore")
        for a in range(0, codes.shape[0], rows):
            b = min(codes.shape[0], a + rows)
            s = scales[a:b].double()
            qw = torch._make_per_channel_quantized_tensor(codes[a:b].contiguous(), s,
                                                          torch.zeros(b - a, dtype=torch.long), 0)
            out.append(torch.ops.quantized.linear_prepack(qw, None))
            del qw
            release_free_heap()  # the block's freed copy: else a hole per block stays resident (below)
    return out


def fbgemm_linear(x_MK: torch.Tensor, packed: list, reduce_range: bool) -> torch.Tensor:
    """``x_MK @ W.T`` (float32 [M, K] in, float32 [M, N] out) over the blocks of :func:`fbgemm_prepack`."""
    ys = [torch.ops.quantized.linear_dynamic(x_MK, p, reduce_range) for p in packed]
    return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
