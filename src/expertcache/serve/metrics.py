"""Prometheus metrics of the server (:class:`Metrics`, in its own registry)."""

__all__ = ["Metrics"]


class Metrics:
    """Prometheus metrics in their own registry (several servers in one process stay apart)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("expertcache_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.queue = Gauge("expertcache_queue_length", "requests waiting to join the batch", registry=r)
        self.batch = Gauge("expertcache_batch_size", "rows in the running decode batch", registry=r)
        self.step_rows = Histogram("expertcache_decode_batch_rows", "rows per decode step",
                                   buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.tokens = Counter("expertcache_generated_tokens", "tokens generated (prefills' first tokens and decode "
                              "steps)", registry=r)
        self.tok_s = Gauge("expertcache_decode_tokens_per_second",
                           "decode tokens per second of compute over the last 32 decode steps", registry=r)
        self.hits = Counter("expertcache_expert_hits", "expert-cache hits (all layers)", registry=r)
        self.misses = Counter("expertcache_expert_misses", "expert-cache misses (all layers)", registry=r)
        self.bytes = Counter("expertcache_expert_bytes_read", "bytes read from the slow tier", registry=r)
        self.hit_rate = Gauge("expertcache_expert_hit_rate", "hits / (hits + misses) since start", registry=r)
        self.ttft = Histogram("expertcache_time_to_first_token_seconds", "submit to first token", registry=r)
        self._recent: list[tuple[int, float]] = []
        self._h = self._m = 0

    def on_step(self, rows: int, tokens: int, seconds: float, delta: dict) -> None:
        self.hits.inc(delta["hits"])
        self.misses.inc(delta["misses"])
        self.bytes.inc(delta["bytes_read"])
        self._h += delta["hits"]
        self._m += delta["misses"]
        if self._h + self._m:
            self.hit_rate.set(self._h / (self._h + self._m))
        self.tokens.inc(tokens)
        if rows:
            self.step_rows.observe(rows)
            self._recent = (self._recent + [(tokens, seconds)])[-32:]
            t = sum(s for _, s in self._recent)
            if t > 0:
                self.tok_s.set(sum(n for n, _ in self._recent) / t)

    def on_queue(self, waiting: int, rows: int) -> None:
        self.queue.set(waiting)
        self.batch.set(rows)

