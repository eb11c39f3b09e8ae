"""The running batch's KV cache: one transformers ``DynamicCache`` whose rows are left-padded to a common
length L, plus the [B, L] attention mask that says which columns of each row are real.

Letter legend: B rows, H key/value heads, L cached columns, d head dim, P a new row's prompt length.

transformers 5.x keeps a ``DynamicCache`` as ``cache.layers[i].keys/values`` tensors [B, H, L, d]; it has
``batch_select_indices`` (keep rows) but nothing that adds a row, so :func:`merge_row` writes those tensors
directly. Padding columns hold zeros and are masked out of attention (mask 0); position ids come from the
mask (a row's positions count its real tokens only), so a row's numbers do not depend on its padding.
"""

from __future__ import annotations

import torch

__all__ = ["BatchKV", "merge_row", "drop_rows", "trim_left"]


def _layers(cache):
    return [layer for layer in cache.layers if getattr(layer, "is_initialized", False)]


def merge_row(cache, mask_BL: torch.Tensor | None, row_cache) -> tuple[object, torch.Tensor]:
    """Append the single-row ``row_cache`` ([1, H, P, d] per layer, no padding) to the batch ``cache`` (rows
    [B, H, L, d], mask ``mask_BL``; ``None``/``None`` for an empty batch). The shorter side is left-padded to
    max(L, P). Returns (cache, mask [B + 1, max(L, P)]); ``cache`` is modified in place (or is ``row_cache``
    when the batch was empty)."""
    rows = _layers(row_cache)
    if not rows:
        raise ValueError("the new row's cache is empty (prefill it first)")
    P = rows[0].keys.shape[2]
    if rows[0].keys.shape[0] != 1:
        raise ValueError(f"merge_row takes one row, got {rows[0].keys.shape[0]}")
    row_mask_1P = torch.ones(1, P, dtype=torch.long)
    if cache is None:
        return row_cache, row_mask_1P
    layers = _layers(cache)
    if len(layers) != len(rows):
        raise ValueError(f"batch cache has {len(layers)} layers, the new row {len(rows)}")
    L = layers[0].keys.shape[2]
    n = max(L, P)
    pad = torch.nn.functional.pad  # (0, 0, k, 0): k zero columns on the left of [B, H, L, d]
    for a, b in zip(layers, rows):
        a.keys = torch.cat([pad(a.keys, (0, 0, n - L, 0)), pad(b.keys, (0, 0, n - P, 0))], dim=0)
        a.values = torch.cat([pad(a.values, (0, 0, n - L, 0)), pad(b.values, (0, 0, n - P, 0))], dim=0)
    mask_BL = torch.cat([pad(mask_BL, (n - L, 0)), pad(row_mask_1P, (n - P, 0))])
    return cache, mask_BL


def drop_rows(cache, mask_BL: torch.Tensor, keep: list[int]) -> tuple[object, torch.Tensor] | tuple[None, None]:
    """Keep only rows ``keep`` (in that order); the dropped rows' tensors are released. Columns that became
    padding in every kept row are trimmed. (None, None) when nothing is kept."""
    if not keep:
        return None, None
    if len(keep) == mask_BL.shape[0] and keep == list(range(len(keep))):
        return cache, mask_BL
    layers = _layers(cache)
    dev = layers[0].keys.device if layers else mask_BL.device  # the KV rows live on the compute device
    cache.batch_select_indices(torch.tensor(keep, dtype=torch.long, device=dev))
    return trim_left(cache, mask_BL[torch.tensor(keep, dtype=torch.long, device=mask_BL.device)])


def trim_left(cache, mask_BL: torch.Tensor) -> tuple[object, torch.Tensor]:
    """Drop leading columns that are padding in every row (keeps the cache as short as its longest row)."""
    real_L = mask_BL.bool().any(dim=0)
    first = int(real_L.nonzero()[0]) if bool(real_L.any()) else mask_BL.shape[1]
    if first == 0:
        return cache, mask_BL
    for layer in _layers(cache):
        layer.keys = layer.keys[:, :, first:].contiguous()
        layer.values = layer.values[:, :, first:].contiguous()
    return cache, mask_BL[:, first:]


class BatchKV:
    """Convenience holder: the batch cache, its mask and each row's next position (real tokens so far)."""

    def __init__(self) -> None:
        self.cache = None
        self.mask_BL: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return 0 if self.mask_BL is None else self.mask_BL.shape[0]

    @property
    def padded(self) -> bool:
        return self.mask_BL is not None and not bool(self.mask_BL.bool().all())

    def add(self, row_cache) -> None:
        self.cache, self.mask_BL = merge_row(self.cache, self.mask_BL, row_cache)

    def keep(self, keep: list[int]) -> None:
        self.cache, self.mask_BL = drop_rows(self.cache, self.mask_BL, keep)

    def positions_B1(self) -> torch.Tensor:
        """Position id of each row's next token: its count of real cached tokens."""
        return self.mask_BL.sum(dim=1, keepdim=True)

    def step_mask(self) -> torch.Tensor:
        """[B, L + 1] mask of a decode step (the new column is real for every row); becomes the new mask."""
        self.mask_BL = torch.cat([self.mask_BL, torch.ones(self.rows, 1, dtype=self.mask_BL.dtype)], dim=1)
        return self.mask_BL

    def nbytes(self) -> int:
        if self.cache is None:
            return 0
        return sum(t.numel() * t.element_size() for layer in _layers(self.cache) for t in (layer.keys, layer.values))
