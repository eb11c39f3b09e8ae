"""The tensors of the experts in the slots, kept: an expert's views per slot, and the arena per matrix.

:class:`SlotViews` turns "expert ``e`` of layer ``i`` is in slot ``s``" into the tensors its MLP reads
(:func:`~expertcache.offload.layout.expert_views`: views of the slot, no copy where the storage dtype is the
compute dtype; the fused kernels' views for quantised experts) and keeps them: views depend only on the slot and
the expert's layout there, so experts of one layout (every expert of the host tier) reuse a slot's views, no view
ops per miss. It also keeps the arena seen as one strided tensor per matrix (the grouped product, the captured
step's in-graph product). One :class:`SlotViews` per arena: a new arena (a new capacity) gets new views.

Where int4 experts run on FBGEMM (:func:`~expertcache.offload.fbexperts.slot_kernel`), every expert is resident
(C = N) and the memory plan counts the copies (``copies``), what an expert's MLP reads is not a view but a packed
copy of the expert (:mod:`~expertcache.offload.fbexperts`), made from the views the first time the expert is
computed from its slot and kept in the slot's placement: a read into the slot resets the placement
(``SlotReads.submit``), so the copy never outlives the bytes it was made from.
"""

from __future__ import annotations

import torch

from expertcache.offload.fbexperts import slot_kernel, slot_prepack
from expertcache.offload.layout import arena_matrix_views, expert_views
from expertcache.offload.quant import QuantLayout
from expertcache.offload.slots import SlotArena

__all__ = ["SlotViews", "layout_ids"]


def layout_ids(parts: dict, placement: dict) -> dict:
    """(MoE layer index, expert) -> a small id per distinct layout of the expert in its slot (offsets, read
    ranges, tensor shapes, dtype): experts with one id have views at the same offsets of their slots."""
    sigs: dict[tuple, int] = {}
    return {k: sigs.setdefault((tuple(p.at), tuple((r.dest, r.nbytes) for r in parts[k].reads),
                                tuple(parts[k].tensors().items()), parts[k].dtype), len(sigs))
            for k, p in placement.items()}


class SlotViews:
    """Views of the experts in ``arena``'s slots (see the module docstring). ``parts`` / ``placement`` /
    ``layout_of``: (MoE layer index, expert) -> its ExpertParts, Placement, layout id (:func:`layout_ids`);
    ``dtype``: the compute dtype; ``quant``: the slots' quantised layout, or None; ``copies``: whether the memory plan
    counts FBGEMM's per-slot copies (module docstring)."""

    def __init__(self, arena: SlotArena, parts: dict, placement: dict, layout_of: dict, dtype: torch.dtype,
                 quant: QuantLayout | None, *, copies: bool = True) -> None:
        self.arena, self.parts, self.placement, self.layout_of = arena, parts, placement, layout_of
        self.dtype, self.quant = dtype, quant
        self._per_slot: dict[int, dict[int, tuple]] = {}  # slot -> layout id -> the expert tensors' views
        self._per_matrix: dict[tuple, tuple] = {}  # layout key -> the arena per matrix
        fbgemm = quant is not None and slot_kernel(quant, arena.buffer.device) == "fbgemm"
        every = arena.capacity > max((e for _, e in parts), default=-1)  # every expert resident: C = N
        self.prepack = slot_prepack(quant) if fbgemm and every and copies else None  # views -> FBGEMM copy

    def weights(self, index: int, e: int, slot: int) -> tuple[torch.Tensor, ...]:
        """Expert ``e`` of MoE layer ``index``'s tensors as views of ``slot`` (cached per slot while it holds it);
        its FBGEMM copy where the experts run on FBGEMM (module docstring)."""
        key = (index, e)
        held = self.arena.placement.get(slot)
        if held is not None and held[0] == key and held[2] is not None:
            return held[2]
        parts, quant = self.parts[key], self.quant
        if parts.dtype != self.dtype and quant is None:  # converted copies, not views: made for this expert only
            w = expert_views(self.arena.buffer[slot], parts, self.placement[key], self.dtype)
            self.arena.placement[slot] = (key, self.placement[key], w)
            return w
        sig = self.layout_of[key]
        kept = self._per_slot.setdefault(slot, {})
        w = kept.get(sig)
        if w is None:
            w = expert_views(self.arena.buffer[slot], parts, self.placement[key], self.dtype, quant)
            if len(kept) >= 4:  # disk O_DIRECT placements vary with file alignment: keep a few per slot
                kept.pop(next(iter(kept)))
            kept[sig] = w
        if self.prepack is not None:  # this expert's own copy, for as long as the slot holds it
            w = self.prepack(w)
        self.arena.placement[slot] = (key, self.placement[key], w)
        return w

    def per_matrix(self, ws: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up [n, 2F, D], down [n, D, F]): every slot of the arena as one strided tensor per matrix, where
        the experts ``ws`` (their views) sit at one offset of their slots; None otherwise
        (:func:`~expertcache.offload.layout.arena_matrix_views`). Kept per layout."""
        got = arena_matrix_views(self.arena.buffer, ws, self.arena.slot_bytes)
        if got is None:
            return None
        key, views = got
        return self._per_matrix.setdefault(key, views)

    def inline(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The per-matrix views for the captured decode step's in-graph products
        (:func:`~expertcache.offload.layout.inline_product`), marked as static graph inputs (CUDA graphs read
        the arena in place, not a copy); None where the experts sit at more than one layout in their slots."""
        if len(set(self.layout_of.values())) != 1:
            return None
        key = next(iter(self.parts))
        views = self.per_matrix([expert_views(self.arena.buffer[0], self.parts[key], self.placement[key],
                                              self.dtype)])
        for v in views or ():  # graph inputs at a fixed address
            torch._dynamo.mark_static_address(v)
        return views
