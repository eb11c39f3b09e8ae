"""Recording of a patched model's routing (:class:`Recording`, a part of :class:`~expertcache.models.patch.MoEPatch`):
per row, layer and forward call, the router logits, the selected ids and their weights, assembled into a
:class:`expertcache.trace.RoutingTrace`."""

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
    """``_rec[row][layer][call]`` of the current sequence(s) and ``_done`` finished sequences."""

    def _record(self, row: int, li: int, z_PE, ids_PK, w_PK) -> None:
        self._rec[row][li].append(_Recorded(z_PE.float().numpy().copy(), ids_PK.numpy().astype(np.int32),
                                            w_PK.float().numpy().copy()))

    def _assemble_rows(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        seqs = []
        for row in self._rec:
            if not row[0]:
                continue
            per_layer = [(np.concatenate([r.logits_SE for r in calls]), np.concatenate([r.ids_SK for r in calls]),
                          np.concatenate([r.weights_SK for r in calls])) for calls in row]
            lengths = {p[0].shape[0] for p in per_layer}
            if len(lengths) != 1:
                raise RuntimeError(f"recorded layers saw different token counts {sorted(lengths)}")
            seqs.append(tuple(np.stack([p[i] for p in per_layer], axis=1) for i in range(3)))
        return seqs

    def _finish_recording(self) -> None:
        self._done.extend(self._assemble_rows())
        self._rec = []

    def trace(self):
        """A :class:`expertcache.trace.RoutingTrace` of everything recorded so far (finished sequences, then
        the rows of the current one; one sequence per row per ``new_sequence``), with the router logits,
        the selected ids (descending weight, -1 = dropped) and their combine weights."""
        from expertcache.trace import RoutingTrace, TraceMeta

        if not self.record:
            raise ValueError("nothing recorded: patch the model with record=True")
        seqs = self._done + self._assemble_rows()
        n_l, e, k = len(self.layers), self.num_experts, self.top_k
        if seqs:
            logits = np.concatenate([sq[0] for sq in seqs]).astype(np.float32)
            ids = np.concatenate([sq[1] for sq in seqs])
            weights = np.concatenate([sq[2] for sq in seqs]).astype(np.float32)
        else:
            logits, ids, weights = (np.zeros((0, n_l, e), np.float32), np.zeros((0, n_l, k), np.int32),
                                    np.zeros((0, n_l, k), np.float32))
        starts = list(np.cumsum([0] + [sq[0].shape[0] for sq in seqs[:-1]]).astype(int)) if seqs else [0]
        d = self.describe()
        meta = TraceMeta(model=d["model"] or self.family.model_type, num_experts=e, top_k=k,
                         renormalize=self.renormalize, num_layers=n_l, scoring=self.family.scoring,
                         source="live:" + self.family.model_type, layer_ids=[m.layer_id for m in self.layers],
                         sequence_starts=[int(x) for x in starts], extra={"patch": d})
        return RoutingTrace(logits_TLE=logits, ids_TLK=ids, meta=meta, weights_TLK=weights)
