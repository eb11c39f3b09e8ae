"""The live caches of a patched model (:class:`CacheStreams`, a part of :class:`~expertcache.models.patch.MoEPatch`):
one cache per batch row and MoE layer, deferred bulk serving of residency-independent selections, statistics.
The state is set up by ``MoEPatch.__init__``; see the patch module's docstring for the contracts."""

from __future__ import annotations

import numpy as np
import torch

from expertcache.cache import CacheStats, ExpertCache, make_cache

__all__ = ["CacheStreams"]

_MAX_PENDING = 4096  # deferred tokens per (row, layer) before they are served anyway (bounds the memory)


class CacheStreams:
    """Per-row, per-layer caches: ``_streams[row][layer]``, retired statistics, the deferred-serving queue."""

    def _new_caches(self) -> list[ExpertCache]:
        return [make_cache(self.eviction, self.num_experts, self.capacity, initial=self.initial,
                           seed=self.seed + m.index, gamma=self.gamma) for m in self.layers]

    def _ensure_rows(self, rows: int) -> None:
        while self.capacity is not None and len(self._streams) < rows:
            self._streams.append(self._new_caches())
        while len(self._rec) < rows:
            self._rec.append([[] for _ in self.layers])

    @property
    def caches(self) -> list[ExpertCache]:
        """The live caches of batch row 0, one per MoE layer (empty list without a cache)."""
        if self.capacity is None:
            return []
        self._ensure_rows(1)
        self._flush()
        return self._streams[0]

    @property
    def row_caches(self) -> list[list[ExpertCache]]:
        """All live caches, ``[row][layer]``."""
        self._flush()
        return self._streams

    def _queue(self, row: int, li: int, ids_PK: torch.Tensor, z_PE: torch.Tensor) -> None:
        """Defer serving a residency-independent selection (served in call order by :meth:`_flush`)."""
        key = (row, li)
        self._pending.setdefault(key, []).append((ids_PK.numpy().copy(), z_PE.float().numpy().copy()))
        n = self._pending_tokens.get(key, 0) + ids_PK.shape[0]
        self._pending_tokens[key] = n
        if n >= _MAX_PENDING:
            self._flush(key)

    def _flush(self, key: tuple[int, int] | None = None) -> None:
        """Serve the deferred selections (of one (row, layer), or all) in bulk: ids ordered by descending
        logit (stable, -1 last, as ``order_by_logits``), then ``cache.serve_array``."""
        if not self._pending:
            return
        for k in ([key] if key is not None else list(self._pending)):
            items = self._pending.pop(k, None)
            self._pending_tokens.pop(k, None)
            if not items:
                continue
            ids_PK = np.concatenate([i for i, _ in items]) if len(items) > 1 else items[0][0]
            z_PE = np.concatenate([z for _, z in items]) if len(items) > 1 else items[0][1]
            self._streams[k[0]][k[1]].serve_array(ids_PK, order_by=z_PE)

    def reset_caches(self) -> None:
        """Replace every cache by a fresh one (initial state); statistics so far are kept in ``stats()``."""
        self._flush()
        for row in self._streams:
            for li, cache in enumerate(row):
                self._retire(li, cache)
        self._streams = []

    def _retire(self, li: int, cache: ExpertCache) -> None:
        s = cache.finish()
        self._retired[li] = s if self._retired[li] is None else self._retired[li].merge(s)

    def new_sequence(self) -> None:
        """End the current sequence(s): close their recording; with ``between_sequences='reset'`` also
        start fresh caches; then call the hooks of :meth:`on_new_sequence` in the order they were added."""
        self._finish_recording()
        if self.between_sequences == "reset":
            self.reset_caches()
        for hook in getattr(self, "_sequence_hooks", ()):
            hook()

    def on_new_sequence(self, hook) -> None:
        """Call ``hook()`` at the end of every :meth:`new_sequence` (e.g. a prefetcher loading the next item's
        experts into the fresh caches): the named seam for observers, instead of replacing the method."""
        if not hasattr(self, "_sequence_hooks"):
            self._sequence_hooks = []
        self._sequence_hooks.append(hook)

    def stats(self):
        """Cache statistics so far as an :class:`expertcache.sim.SimResult` (``per_layer`` CacheStats,
        ``overall``, ``miss_rate`` = misses / (tokens · L · K), ``to_row()``), over all rows and sequences."""
        from expertcache.sim import SimResult

        if self.capacity is None:
            raise ValueError("this patch has no cache (capacity=None): there are no cache statistics")
        self._flush()
        per_layer = []
        for li in range(len(self.layers)):
            total = self._retired[li]
            for row in self._streams:
                s = row[li].finish()
                total = s if total is None else total.merge(s)
            per_layer.append(total if total is not None else CacheStats(self.num_experts))
        return SimResult(per_layer, top_k=self.top_k, config=self.describe())
