"""expertcache: run Mixture-of-Experts models with a per-layer expert cache and cache-aware routing.

Seams (one idea each):

- ``expertcache.routing`` -- pure, batched routing policies (logits, residency mask -> ids, weights).
- ``expertcache.cache``   -- per-layer expert caches (LRU, LFU, 004's gamma, gamma-admit, Belady); plain Python, no torch.
- ``expertcache.trace``   -- the on-disk routing-trace format.
- ``expertcache.sim``     -- the open-loop cache simulator (replays a trace under a policy and a cache).
- ``expertcache.models``  -- the only transformers-aware code: adapters that patch real HF MoE models.
- ``expertcache.train``   -- training the small shipped default models.
- ``expertcache.cli``     -- the ``expertcache`` command.
"""

__version__ = "0.1.0"
