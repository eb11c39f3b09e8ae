"""The live view's tap on the runtime (:class:`Tap`): per MoE layer, what each cache step did, turned into one
frame per forward and published to the :class:`~expertcache.serve.broker.Broker`.

The tap only observes, through named hooks (docs/ARCHITECTURE.md, "Observing the runtime"): the runtime's step,
prefetch and router observers (one cache step per MoE layer per forward, prefetch loads, the router logits of
the shadow route) and the engine's forward observer (engine thread, after every forward)."""

import collections
import time

from expertcache.serve.broker import Broker, sorted_ids

__all__ = ["Tap"]


class Tap:
    """Records, per MoE layer, what each cache step did, and turns every forward into a frame.

    Observes through named hooks, changing nothing: the runtime's step, prefetch and router observers
    (:mod:`expertcache.offload.observe`, active only while someone subscribes) and the engine's forward
    observer (:meth:`Engine.add_forward_observer`, engine thread, after each forward). Frames are built only
    while someone subscribes; running totals always."""

    def __init__(self, engine, broker: Broker, control=None) -> None:
        self.rt, self.broker, self.control = engine.rt, broker, control
        self._acc = self._empty()
        self.seq = 0
        self.totals = dict(tokens=0, hits=0, misses=0, low_computes=0, prefetched=0, bytes_read=0, forwards=0, decode_tokens=0,
                           decode_bytes=0, decode_seconds=0.0)
        self._recent: collections.deque = collections.deque(maxlen=32)
        # the shadow: what original routing would have hit on the same tokens (cache-aware policies only)
        self.shadow: list | None = None
        self._shadow_acc = [0, 0]
        self.shadow_totals = dict(hits=0, misses=0, policy_hits=0, policy_misses=0, since_seq=0)
        subscribed = lambda: bool(self.broker.subscribers)  # noqa: E731
        self.rt.add_step_observer(self._on_cache_step, when=subscribed)
        self.rt.add_prefetch_observer(self._on_prefetch)  # always: the totals count prefetch loads
        self.rt.add_router_observer(self._on_route, when=lambda: subscribed() and self.rt.routing.cache_aware)
        engine.add_forward_observer(self._after_forward)

    def _on_cache_step(self, ev) -> None:
        a = self._acc[ev.layer]
        if ev.kind == "prefetch":  # OffloadedModel.prefetch's loads: not demand misses
            a["prefetched"].update(ev.admitted)
        else:
            a["requested"].extend(ev.order)
            for e, hit in zip(ev.order, ev.hits):
                (a["hit"] if hit else a["miss"]).add(e)
            a["low"].update(ev.low)  # computed at 4 bits instead of loaded (--resident-quant)
        a["evicted"].update(ev.evicted)

    def _on_prefetch(self, ev) -> None:
        if ev.kind == "explicit":
            self.totals["prefetched"] += len(ev.loaded)  # loads too: counted in the totals' transfers

    def _on_route(self, ev) -> None:
        self._shadow_route(self.rt.layers[ev.layer], ev.logits)

    def _after_forward(self, rows, tokens, seconds, delta) -> None:
        try:
            self._on_forward(rows, tokens, seconds, delta)
        finally:
            if self.control is not None:
                self.control.apply_pending()  # between two forwards, in the engine thread

    def _shadow_route(self, m, z_TE) -> None:
        """Route the forward's tokens at layer ``m`` with original routing and serve them from the shadow cache
        (the union of the rows' experts by total weight, as the runtime serves a step)."""
        from expertcache.cache import make_cache
        from expertcache.models.adapters import order_by_logits
        from expertcache.offload.step import union_order
        from expertcache.routing import topk_rank

        rt = self.rt
        if self.shadow is None:  # starts from what the live caches hold now
            self.shadow = [make_cache(rt.eviction, rt.num_experts, rt.capacity, gamma=rt.gamma,
                                      initial=sorted(st.cache.resident()))
                           for st in rt.states]
            self.shadow_totals = dict(hits=0, misses=0, policy_hits=0, policy_misses=0, since_seq=self.seq + 1)
        z_cpu_TE = z_TE.detach().to("cpu")
        zr_TE, allowed_TE = rt.family.ranking(m.router, z_cpu_TE)
        if allowed_TE is not None:
            zr_TE = zr_TE.masked_fill(~allowed_TE, float("-inf"))
        ids_TK = order_by_logits(topk_rank(zr_TE, rt.top_k), z_cpu_TE)
        w_TK = None if ids_TK.shape[0] == 1 else rt.family.weights(m.router, z_cpu_TE, ids_TK)  # one token: its order
        order = union_order(ids_TK, w_TK, rt.num_experts)
        hits = self.shadow[m.index].access_step(order)
        self._shadow_acc[0] += sum(hits)
        self._shadow_acc[1] += len(hits) - sum(hits)

    def _empty(self) -> list[dict]:
        return [dict(requested=[], hit=set(), miss=set(), low=set(), evicted=set(), prefetched=set())
                for _ in self.rt.layers]

    def _on_forward(self, rows: int, tokens: int, seconds: float, delta: dict) -> None:
        t = self.totals
        h, m, b = int(round(delta["hits"])), int(round(delta["misses"])), int(delta["bytes_read"])
        t["tokens"] += tokens
        t["hits"] += h
        t["misses"] += m
        t["low_computes"] += int(round(delta.get("low_computes", 0)))
        t["bytes_read"] += b
        t["forwards"] += 1
        if rows:  # a decode step
            t["decode_tokens"] += tokens
            t["decode_bytes"] += b
            t["decode_seconds"] += seconds
            self._recent.append((tokens, seconds))
        if not self.broker.subscribers:
            self._acc = self._empty()
            self._shadow_acc = [0, 0]
            self.shadow = None
            return
        acc, self._acc = self._acc, self._empty()
        self.seq += 1
        n_s = sum(s for _, s in self._recent)
        layers = []
        for st, a in zip(self.rt.states, acc):
            layers.append(dict(requested=a["requested"], hit=sorted_ids(a["hit"]), miss=sorted_ids(a["miss"]),
                               low=sorted_ids(a["low"]),
                               evicted=sorted_ids(a["evicted"]), prefetched=sorted_ids(a["prefetched"]),
                               resident=sorted_ids(st.cache.resident())))
        acc_n = t["hits"] + t["misses"]
        shadow = None
        if self.shadow is not None and self.rt.routing.cache_aware:
            sh = self.shadow_totals
            sh["hits"] += self._shadow_acc[0]
            sh["misses"] += self._shadow_acc[1]
            sh["policy_hits"] += h
            sh["policy_misses"] += m
            n0, n1 = sh["hits"] + sh["misses"], sh["policy_hits"] + sh["policy_misses"]
            shadow = dict(sh, hit_rate=sh["hits"] / n0 if n0 else None,
                          policy_hit_rate=sh["policy_hits"] / n1 if n1 else None)
        self._shadow_acc = [0, 0]
        frame = dict(type="step", seq=self.seq, time=time.time(), phase="decode" if rows else "prefill", rows=rows,
                     tokens=tokens, seconds=seconds, hits=h, misses=m, bytes_read=b, layers=layers,
                     totals=dict(t, hit_rate=(t["hits"] / acc_n) if acc_n else None,
                                 transfers=t["misses"] + t["prefetched"],
                                 bytes_per_token=(t["decode_bytes"] / t["decode_tokens"]) if t["decode_tokens"]
                                 else None,
                                 tok_s=(sum(n for n, _ in self._recent) / n_s) if n_s > 0 else None),
                     original=shadow)
        self.broker.publish(frame)
