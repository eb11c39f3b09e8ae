"""Recording of a patched model's routing (:class:`Recording`, a part held by
:class:`~expertcache.models.patch.MoEPatch` as ``patch.recording``): per row, layer and forward call, the router
logits, the selected ids and their weights, assembled into arrays per sequence (the patch wraps them into a
:class:`expertcache.trace.RoutingTrace`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Recording"]


@dataclass
class _Recorded:
    """One row's selections at one layer for one forward call (real tokens only), numpy."""

    logits_SE: np.ndarray
    ids_SK: np.ndarray
    weights_SK: np.ndarray


class Recording:
    """``rows[row][layer][call]`` of the current sequence(s) and the finished sequences, for ``num_layers``
    MoE layers of ``num_experts`` experts, K = ``top_k`` per token."""

    def __init__(self, *, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.rows: list[list[list[_Recorded]]] = []  # [row][layer][call]
        self._done: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # finished sequences (TLE, TLK, TLK)

    def ensure_rows(self, rows: int) -> None:
        while len(self.rows) < rows:
            self.rows.append([[] for _ in range(self.num_layers)])

    def record(self, row: int, li: int, z_PE, ids_PK, w_PK) -> None:
        """Keep row ``row``'s logits [P, E], ids [P, K] and weights [P, K] at layer ``li`` (torch, host)."""
        self.rows[row][li].append(_Recorded(z_PE.float().numpy().copy(), ids_PK.numpy().astype(np.int32),
                                            w_PK.float().numpy().copy()))

    def _assemble_rows(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        seqs = []
        for row in self.rows:
            if not row[0]:
                continue
            per_layer = [(np.concatenate([r.logits_SE for r in calls]), np.concatenate([r.ids_SK for r in calls]),
                          np.concatenate([r.weights_SK for r in calls])) for calls in row]
            lengths = {p[0].shape[0] for p in per_layer}
            if len(lengths) != 1:
                raise RuntimeError(f"recorded layers saw different token counts {sorted(lengths)}")
            seqs.append(tuple(np.stack([p[i] for p in per_layer], axis=1) for i in range(3)))
        return seqs

    def finish_sequence(self) -> None:
        """Close the current sequence(s): each row recorded so far becomes one finished sequence."""
        self._done.extend(self._assemble_rows())
        self.rows = []

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """Everything recorded so far (finished sequences, then the rows of the current one): logits [T, L, E]
        float32, ids [T, L, K] (descending weight, -1 = dropped), weights [T, L, K] float32 and the first
        token of each sequence."""
        seqs = self._done + self._assemble_rows()
        n_l, e, k = self.num_layers, self.num_experts, self.top_k
        if seqs:
            logits = np.concatenate([sq[0] for sq in seqs]).astype(np.float32)
            ids = np.concatenate([sq[1] for sq in seqs])
            weights = np.concatenate([sq[2] for sq in seqs]).astype(np.float32)
        else:
            logits, ids, weights = (np.zeros((0, n_l, e), np.float32), np.zeros((0, n_l, k), np.int32),
                                    np.zeros((0, n_l, k), np.float32))
        starts = list(np.cumsum([0] + [sq[0].shape[0] for sq in seqs[:-1]]).astype(int)) if seqs else [0]
        return logits, ids, weights, [int(x) for x in starts]
