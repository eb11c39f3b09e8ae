"""MELINOE (seed 004): fine-tune the routers for per-sequence locality, predict each prompt's experts from a
sentence embedding, prefetch them before decoding. See docs/MELINOE.md.

- :mod:`expertcache.melinoe.losses`    -- L_cs (soft cache state, fill phase / uniform start) and L_rm (Eq. 4-6);
- :mod:`expertcache.melinoe.finetune`  -- the fine-tuning loop (peft LoRA on the fused experts, routers in full);
- :mod:`expertcache.melinoe.predictor` -- prompt embedding + 2-layer MLP -> per-layer expert preferences;
- :mod:`expertcache.melinoe.prefetch`  -- Top-C of a prediction loaded before decoding.

The γ cache of Definition C.1 is :class:`expertcache.cache.DiscountedCache` (eviction ``gamma``).
"""
