"""The byte layout of an expert in its fast-tier slot, and the tensor math that reads it in place.

The bottom of the offloaded runtime: pure functions of bytes and tensors, no I/O, no state, no policy.

- :class:`Placement` / :func:`place_expert`: where each byte range of an expert goes in its slot (page
  alignment :data:`ALIGN` for ``O_DIRECT`` reads in place, or packed through a bounce buffer);
  :func:`slot_bytes_for`: the slot size for a placement;
- :func:`expert_views`: an expert's tensors as views of its slot (no copy where the dtypes agree);
- :func:`arena_matrix_views`: every slot of an arena seen as one strided tensor per matrix;
- :func:`inline_product` and :func:`grouped_product`: one token's routed experts computed from those per-matrix
  views (the captured step's in-graph product; the eager step's grouped product).

Letter legend: D hidden, F expert intermediate size, K routed experts per token, U experts of one step, n slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from expertcache.device import to_device
from expertcache.offload.checkpoint import ExpertParts
from expertcache.offload.quant import QuantLayout

__all__ = ["ALIGN", "Placement", "place_expert", "slot_bytes_for", "expert_views", "arena_matrix_views",
           "inline_product", "grouped_product"]

#: the page size: ``O_DIRECT`` reads start, end and land at multiples of it; slots are whole pages
ALIGN = 4096


def slot_bytes_for(nbytes: int) -> int:
    """Slot size for placements of up to ``nbytes``: rounded up to whole pages."""
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class Placement:
    """Where one expert's bytes go in its slot.

    spans: ``(file, file offset, length, slot offset, needed)`` per read -- ``needed`` is the least byte
    count that read must return (the aligned tail may run past the end of the file). at: slot byte offset
    of the first byte of each ``ExpertParts.reads[i]``. bounce: the spans go to a bounce buffer first and each
    range is then copied to ``at`` (O_DIRECT when a matrix spans two ranges). nbytes: slot bytes used.
    """

    spans: tuple[tuple[Path, int, int, int, int], ...]
    at: tuple[int, ...]
    bounce: bool
    nbytes: int

    def slot_offset(self, parts: ExpertParts, packed_byte: int) -> int:
        """Slot byte offset of byte ``packed_byte`` of the packed expert (see ExpertParts)."""
        for r, a in zip(parts.reads, self.at):
            if r.dest <= packed_byte < r.dest + r.nbytes:
                return a + packed_byte - r.dest
        raise ValueError(f"byte {packed_byte} is outside the expert ({parts.nbytes} bytes)")


def _in_one_range(parts: ExpertParts, start: int, nbytes: int) -> bool:
    return any(r.dest <= start and start + nbytes <= r.dest + r.nbytes for r in parts.reads)


def place_expert(parts: ExpertParts, io: str, *, packed: bool = False) -> Placement:
    """The :class:`Placement` of ``parts`` for disk reads in mode ``io`` (:mod:`~expertcache.offload.store`).
    Buffered modes read each range to its packed position; ``direct`` reads aligned spans in place when every
    tensor lies in one range and stays element-aligned (and not ``packed``), through a bounce buffer otherwise."""
    if io != "direct":
        spans = tuple((r.file, r.offset, r.nbytes, r.dest, r.nbytes) for r in parts.reads)
        return Placement(spans, tuple(r.dest for r in parts.reads), False, parts.nbytes)
    esize = torch.empty((), dtype=parts.dtype).element_size()
    spans, at, pos = [], [], 0
    for r in parts.reads:
        start = r.offset - r.offset % ALIGN
        end = -(-(r.offset + r.nbytes) // ALIGN) * ALIGN
        spans.append((r.file, start, end - start, pos, r.offset + r.nbytes - start))
        at.append(pos + r.offset - start)
        pos += end - start
    inplace = Placement(tuple(spans), tuple(at), False, pos)
    ok = all(_in_one_range(parts, off * esize, math.prod(shape) * esize)
             and inplace.slot_offset(parts, off * esize) % esize == 0 for off, shape in parts.tensors().values())
    if ok and not packed:
        return inplace
    bounce = tuple((f, o, n, -1, need) for f, o, n, _, need in spans)
    return Placement(bounce, tuple(r.dest for r in parts.reads), True, parts.nbytes)


def expert_views(blob_u8: torch.Tensor, parts: ExpertParts, placement: Placement, dtype: torch.dtype,
                 quant: QuantLayout | None = None) -> tuple[torch.Tensor, ...]:
    """The expert's tensors (``ExpertParts.tensors()`` order) as views of its slot ``blob_u8``, in ``dtype``
    (a view when the storage dtype is ``dtype``). Quantised experts: the fused kernels' four tensors
    (:meth:`QuantLayout.views`), views too, for :func:`~expertcache.offload.quant.quant_mlp`."""
    if quant is not None:
        at = placement.slot_offset(parts, 0)
        return quant.views(blob_u8[at:at + parts.nbytes])
    esize = parts.dtype.itemsize
    out = []
    for off, shape in parts.tensors().values():
        at = placement.slot_offset(parts, off * esize)
        t = blob_u8[at:at + math.prod(shape) * esize].view(parts.dtype).view(shape)
        out.append(t if t.dtype == dtype else t.to(dtype))
    return tuple(out)


def arena_matrix_views(buffer_nB: torch.Tensor, ws: list[tuple[torch.Tensor, ...]], slot_bytes: int
                       ) -> tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None:
    """(a key of the layout, (gate_up [n, 2F, D], down [n, D, F])): every slot of the arena ``buffer_nB``
    ([n, slot_bytes] uint8) seen as one strided tensor per matrix, where the experts ``ws`` (their (gate_up, down,
    ...) views into the arena) sit at one offset of their slots (the host tier's single layout; disk placements
    vary with file alignment: None). Equal keys give equal views (the caller may keep them by key)."""
    first = ws[0]
    el = first[0].element_size()
    base = buffer_nB.data_ptr()
    where = {tuple((t.data_ptr() - base) % slot_bytes for t in w[:2]) for w in ws}
    if len(where) != 1 or slot_bytes % el or not all(t.is_contiguous() for t in first[:2]):
        return None
    offs = where.pop()
    key = (offs, first[0].shape, first[1].shape, first[0].dtype)
    flat = buffer_nB.view(first[0].dtype)  # [n, slot_bytes / el]
    n, stride = flat.shape[0], flat.shape[1]
    return key, tuple(flat.as_strided((n, *t.shape), (stride, t.shape[1], 1), off // el)
                      for t, off in zip(first[:2], offs))


def inline_product(views: tuple[torch.Tensor, torch.Tensor], x_TD: torch.Tensor, slot_K: torch.Tensor,
                   w_TK: torch.Tensor, act: Callable) -> torch.Tensor:
    """[1, D]: one token's routed experts computed from the arena's slots (``views``: :func:`arena_matrix_views`)
    as traced code of the captured decode step: each position k of ``slot_K`` >= 0 contributes
    ``w_TK[0, k] * down[slot] @ (act(gate) * up)`` with ``gate, up = gate_up[slot] @ x`` (the family's ``linear``
    MLP); positions < 0 contribute nothing. Written as broadcast products summed over the inner dimension, which
    the compiler fuses into one reduction per matrix that reads the slots in place (no gathered copy of the
    weights); the products' sums may round differently from ``mv``'s."""
    gate_up, down = views
    keep_K = slot_K >= 0
    s_K = slot_K.clamp(min=0)
    x_D = x_TD[0]
    gu_KF2 = (gate_up[s_K] * x_D).sum(-1)
    gate_KF, up_KF = gu_KF2.chunk(2, dim=-1)
    a_KF = act(gate_KF) * up_KF
    h_KD = (down[s_K] * a_KF[:, None, :]).sum(-1)
    hw_KD = torch.where(keep_K[:, None], h_KD * w_TK[0, :, None].to(h_KD.dtype), 0)  # a skipped slot may hold NaN
    return hw_KD.sum(0, keepdim=True).to(x_TD.dtype)


def grouped_product(views: tuple[torch.Tensor, torch.Tensor], x_D: torch.Tensor, slot_of: dict[int, int],
                    ids_K: list[int], w_K: torch.Tensor, act: Callable, how: str) -> torch.Tensor:
    """[D]: the MoE output of one token whose experts ``slot_of`` (expert -> slot; ``ids_K`` its routed ids
    on the host, ``w_K`` their weights on the device) are computed with one product per matrix:
    ``torch._grouped_mm`` over every slot of the arena (``how='grouped_mm'``: a group of one row per slot used,
    empty groups elsewhere: only the step's weights are read) or ``bmm`` of the gathered matrices
    (``how='bmm'``), then combined by one product with the routing weights. The group ends, the slots and the
    weights' positions, in slot order, are built on the host and reach the device in one ``non_blocking``
    copy. Values: the per-expert path's within the dtype's rounding (the sums' order differs)."""
    gate_up, down = views
    n = gate_up.shape[0]
    rows = sorted(slot_of.items(), key=lambda es: es[1])  # (expert, slot) by slot: the products' rows
    u = len(rows)
    slots_U = [slot for _, slot in rows]
    host = np.zeros(n + 2 * u, dtype=np.int64)
    host[slots_U] = 1
    np.cumsum(host[:n], out=host[:n])  # group ends (offsets): one row per used slot, in slot order
    host[n:n + u] = slots_U  # bmm's gather
    host[n + u:] = [ids_K.index(e) for e, _ in rows]  # each row's routing weight
    idx = to_device(torch.from_numpy(host), x_D.device)
    x_UD = x_D.expand(u, x_D.shape[0])
    if how == "grouped_mm":
        offs_n = idx[:n].to(torch.int32)
        gate_UF, up_UF = torch._grouped_mm(x_UD.contiguous(), gate_up.transpose(-2, -1), offs=offs_n).chunk(2, -1)
        h_UD = torch._grouped_mm((act(gate_UF) * up_UF).contiguous(), down.transpose(-2, -1), offs=offs_n)
    else:  # one batched product of the gathered matrices (a copy of the step's weights)
        slot_rows = idx[n:n + u]
        gate_UF, up_UF = torch.bmm(gate_up[slot_rows], x_UD[:, :, None])[..., 0].chunk(2, -1)
        h_UD = torch.bmm(down[slot_rows], (act(gate_UF) * up_UF)[:, :, None])[..., 0]
    return torch.mv(h_UD.T, w_K[idx[n + u:]].to(h_UD.dtype)).to(x_D.dtype)
