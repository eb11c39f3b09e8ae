"""The Router's one-row numpy fast paths select exactly what the batched torch policies select."""

from __future__ import annotations

import zlib

import pytest
import torch

from expertcache.routing import Router, RoutingConfig
from expertcache.routing.policies import (cumsum_threshold_rank, eras_bias_rank, eras_threshold_rank,
                                          max_rank_rank)

E, K = 16, 4


def _reference(cfg: RoutingConfig, z_1E, resident_E, freq_E):
    j = cfg.top_j
    if cfg.policy == "max-rank":
        return max_rank_rank(z_1E, resident_E, K, min(cfg.m, E), j)
    if cfg.policy == "cumsum":
        return cumsum_threshold_rank(z_1E, resident_E, K, cfg.p, j)
    if cfg.policy == "eras-threshold":
        return eras_threshold_rank(z_1E, resident_E, K, cfg.alpha, j)
    return eras_bias_rank(z_1E, resident_E, K, cfg.beta, freq_E, j)


CONFIGS = [RoutingConfig("max-rank", m=m, top_j=j) for m in (0, 2, 6, 16) for j in (0, 1, 2)] + [
    RoutingConfig("cumsum", p=p, top_j=j) for p in (0.0, 0.3, 0.7, 1.0) for j in (0, 1)] + [
    RoutingConfig("eras-threshold", alpha=a, top_j=j) for a in (0.0, 0.05, 0.5) for j in (0, 1)] + [
    RoutingConfig("eras-bias", beta=b, top_j=j) for b in (0.0, 0.7, 3.0) for j in (0, 1)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
def test_one_row_fast_path_equals_batched_policy(cfg):
    gen = torch.Generator().manual_seed(zlib.crc32(cfg.label().encode()))
    freq_LE = torch.softmax(torch.randn(2, E, generator=gen), dim=-1)
    router = Router(cfg, E, K, renormalize=False, freq_LE=freq_LE)
    for t in range(300):
        z = torch.randn(1, E, generator=gen) * (3 if t % 2 else 0.5)
        if t % 3 == 0:  # bf16-rounded logits: many exact ties
            z = z.to(torch.bfloat16).float()
        resident = torch.rand(E, generator=gen) < 0.4
        layer = t % 2
        got = router.rank(layer, z, resident)
        want = _reference(cfg, z, resident, freq_LE[layer])
        assert sorted(got[0].tolist()) == sorted(want[0].tolist()), (t, z, resident)


def test_fast_path_falls_back_for_nan_and_batches():
    router = Router(RoutingConfig("max-rank", m=4), E, K, renormalize=False)
    with pytest.raises(ValueError, match="NaN"):
        router.rank(0, torch.full((1, E), float("nan")), torch.zeros(E, dtype=torch.bool))
    z = torch.randn(3, E)
    assert router.rank(0, z, torch.zeros(E, dtype=torch.bool)).shape == (3, K)
    inf = torch.zeros(1, E)
    inf[0, 5] = float("inf")
    assert 5 in router.rank(0, inf, torch.zeros(E, dtype=torch.bool))[0].tolist()
