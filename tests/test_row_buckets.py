"""Row buckets (offload/experts.py): multi-row bf16 products on a CPU are padded to a few row counts, because
oneDNN keeps a kernel for every row count it sees (~0.66 MiB of RSS each, for the life of the process). The
padding must not change a value: the offloaded model's logits stay equal, bit for bit, to the same forward
with no padding (row counts passed through as they come), for prefills of many lengths and a padded decode
batch, under original and cache-aware routing; and every bf16 product of a forward sees a bucketed row count.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.offload import experts
from expertcache.offload.experts import row_bucket
from expertcache.routing import RoutingConfig

LENGTHS = (2, 3, 37, 100, 150)


def test_row_bucket_values():
    assert [row_bucket(m) for m in (1, 2, 3, 5, 8, 9, 100, 128, 129, 256, 257, 1000)] == \
        [1, 2, 4, 8, 8, 16, 128, 128, 256, 256, 384, 1024]
    assert len({row_bucket(m) for m in range(1, 4097)}) == 8 + 31  # 1..128 as powers of two, then 31 multiples


@pytest.fixture(scope="module", params=["original", "cache-prior"])
def rt(request):
    routing = RoutingConfig(policy="cache-prior", lam=0.5) if request.param == "cache-prior" else None
    rt = OffloadedModel.from_pretrained("granular", OffloadConfig(tier="host", capacity=8), routing=routing)
    assert rt.dtype == torch.bfloat16
    return rt


def _ids(n):
    return torch.tensor([[(37 * i * i + 11 * i + 7) % 8000 + 3 for i in range(n)]])


def _logits(rt):
    rt.configure()  # fresh caches: both runs start alike
    out = []
    with torch.inference_mode():
        for n in LENGTHS:
            out.append(rt.model(_ids(n), use_cache=False).logits)
        r = rt.model(torch.cat([_ids(7)] * 5) + torch.arange(5)[:, None], use_cache=True)  # 5 rows, decoded
        for _ in range(4):
            nxt = r.logits[:, -1].argmax(-1, keepdim=True)
            r = rt.model(nxt, past_key_values=r.past_key_values, use_cache=True)
            out.append(r.logits)
    return out


def test_padded_products_leave_the_logits_bit_identical(rt, monkeypatch):
    padded = _logits(rt)
    monkeypatch.setattr(experts, "row_bucket", lambda m: m)  # every padding goes through experts.bucket_rows
    plain = _logits(rt)
    assert all(torch.equal(a, b) for a, b in zip(padded, plain))


def test_every_bf16_product_of_a_forward_sees_a_bucketed_row_count(rt, monkeypatch):
    seen = []
    linear = F.linear

    def spy(x, w, b=None):
        if x.dtype == torch.bfloat16 and x.numel() > x.shape[-1]:
            seen.append(x.numel() // x.shape[-1])
        return linear(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    with torch.inference_mode():
        for n in range(5, 41):
            rt.model(_ids(n), use_cache=False)
    assert seen, "no multi-row bf16 product was seen"
    assert set(seen) <= {row_bucket(m) for m in range(2, 41)}, sorted(set(seen))
