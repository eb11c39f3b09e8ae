"""The live caches of a patched model (:class:`CacheStreams`, a part held by
:class:`~expertcache.models.patch.MoEPatch` as ``patch.streams``): one cache per batch row and MoE layer,
deferred bulk serving of residency-independent selections, the between-sequences rule, statistics.
See the patch module's docstring for the contracts."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from expertcache.cache import CacheStats, ExpertCache

__all__ = ["CacheStreams", "MAX_PENDING"]

MAX_PENDING = 4096  # deferred tokens per (row, layer) before they are served anyway (bounds the memory)


class CacheStreams:
    """Per-row, per-layer caches ``rows[row][layer]`` (made by ``new_caches()``, one list per row; None: no
    cache, ``rows`` stays empty), the statistics of retired caches, the deferred-serving queue ``pending`` and
    the hooks of :meth:`new_sequence`. ``between_sequences`` is ``'reset'`` (fresh caches per sequence) or
    ``'carry'``."""

    def __init__(self, new_caches: Callable[[], list[ExpertCache]] | None, *, num_layers: int, num_experts: int,
                 between_sequences: str) -> None:
        self.new_caches = new_caches
        self.num_experts = num_experts
        self.between_sequences = between_sequences
        self.rows: list[list[ExpertCache]] = []  # [row][layer]
        self._retired: list[CacheStats | None] = [None] * num_layers
        # selections of residency-independent calls (original routing, nothing recorded) not yet served:
        # (row, layer) -> [(ids int [P, K], logits float32 [P, E]), ...]; served in bulk before anything reads
        # or serves a cache (see flush)
        self.pending: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
        self._pending_tokens: dict[tuple[int, int], int] = {}
        self._sequence_hooks: list[Callable[[], None]] = []

    def ensure_rows(self, rows: int) -> None:
        """Caches for rows ``0 .. rows-1`` (made on first use; none without a cache)."""
        while self.new_caches is not None and len(self.rows) < rows:
            self.rows.append(self.new_caches())

    @property
    def caches(self) -> list[ExpertCache]:
        """The live caches of batch row 0, one per MoE layer (empty list without a cache)."""
        if self.new_caches is None:
            return []
        self.ensure_rows(1)
        self.flush()
        return self.rows[0]

    @property
    def row_caches(self) -> list[list[ExpertCache]]:
        """All live caches, ``[row][layer]``."""
        self.flush()
        return self.rows

    def queue(self, row: int, li: int, ids_PK: torch.Tensor, z_PE: torch.Tensor) -> None:
        """Defer serving a residency-independent selection (served in call order by :meth:`flush`)."""
        key = (row, li)
        self.pending.setdefault(key, []).append((ids_PK.numpy().copy(), z_PE.float().numpy().copy()))
        n = self._pending_tokens.get(key, 0) + ids_PK.shape[0]
        self._pending_tokens[key] = n
        if n >= MAX_PENDING:
            self.flush(key)

    def flush(self, key: tuple[int, int] | None = None) -> None:
        """Serve the deferred selections (of one (row, layer), or all) in bulk: ids ordered by descending
        logit (stable, -1 last, as ``order_by_logits``), then ``cache.serve_array``."""
        if not self.pending:
            return
        for k in ([key] if key is not None else list(self.pending)):
            items = self.pending.pop(k, None)
            self._pending_tokens.pop(k, None)
            if not items:
                continue
            ids_PK = np.concatenate([i for i, _ in items]) if len(items) > 1 else items[0][0]
            z_PE = np.concatenate([z for _, z in items]) if len(items) > 1 else items[0][1]
            self.rows[k[0]][k[1]].serve_array(ids_PK, order_by=z_PE)

    def reset_caches(self) -> None:
        """Replace every cache by a fresh one (initial state); statistics so far are kept in :meth:`per_layer`."""
        self.flush()
        for row in self.rows:
            for li, cache in enumerate(row):
                s = cache.finish()
                self._retired[li] = s if self._retired[li] is None else self._retired[li].merge(s)
        self.rows = []

    def new_sequence(self) -> None:
        """End the current sequence(s): with ``between_sequences='reset'`` start fresh caches; then call the
        hooks of :meth:`on_new_sequence` in the order they were added."""
        if self.between_sequences == "reset":
            self.reset_caches()
        for hook in self._sequence_hooks:
            hook()

    def on_new_sequence(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` at the end of every :meth:`new_sequence`."""
        self._sequence_hooks.append(hook)

    def per_layer(self) -> list[CacheStats]:
        """Cache statistics so far, one per MoE layer, over all rows and sequences (retired caches included)."""
        self.flush()
        out = []
        for li, total in enumerate(self._retired):
            for row in self.rows:
                s = row[li].finish()
                total = s if total is None else total.merge(s)
            out.append(total if total is not None else CacheStats(self.num_experts))
        return out
