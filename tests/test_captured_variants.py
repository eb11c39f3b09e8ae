"""Every captured-step variant in the default suite (issue 44: the variants beyond the plain one were ``slow``
only): one tiny OLMoE-layout model (2 layers, 8 experts, top-2), teacher-forced through the captured step with
prefetch, the disk tier with reads in flight, int8 experts and resident int4 copies, against the eager runtime's
logits, routing decisions and cache counters (tests/test_captured.py holds the full-size checks, ``slow``).

Needs g++ (torch.compile's C++ backend): skipped with that reason without it.

Surviving mutants of this file's own set: ``OffloadedModel.captured_key`` always ``("inline",)`` (the compiled
graphs of an in-graph and an eager-experts runtime of one process share a key; not distinguished here).
"""

from __future__ import annotations

import pytest
import torch

from conftest import decode_logits, save_decisive_olmoe
from expertcache.models.captured import missing_compiler
from test_captured import _captured_logits, _counters, _rt

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(missing_compiler() is not None, reason="torch.compile needs a C++ compiler (g++)")]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_decisive_olmoe(tmp_path_factory.mktemp("olmoe-variants"), 2, 8, 2)


@pytest.mark.parametrize("policy,capacity,prefetch,kw", [
    ("original", None, 0, {}),                                            # plain
    ("original", 3, 2, {}),                                               # prefetch
    ("cache-prior", 3, 0, dict(tier="disk", readers=2)),                  # disk tier, reads in flight
    ("cache-prior", 3, 0, dict(quant="int8")),                            # int8 experts
    ("original", 2, 0, dict(resident_quant="int4", low_threshold=2.0))],  # resident int4 copies
    ids=["plain", "prefetch", "disk", "int8", "resident-int4"])
def test_every_captured_variant_gives_the_eager_logits_and_decisions(tiny_dir, policy, capacity, prefetch, kw):
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(5))
    prefill = 3
    eager = _rt(tiny_dir, compile_=False, policy=policy, capacity=capacity, prefetch=prefetch, **kw)
    want = decode_logits(eager, ids, prefill=prefill)[:, prefill - 1:]
    ids_e, counts_e, low_e = eager.recorded_ids_TLK(), _counters(eager), eager.stats()["low_computes"]
    eager.close()
    rt = _rt(tiny_dir, compile_=True, policy=policy, capacity=capacity, prefetch=prefetch, **kw)
    try:
        assert rt.describe()["captured_experts"] == ("eager" if kw.get("quant") else "graph")
        got = _captured_logits(rt, ids, prefill)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert (rt.recorded_ids_TLK() == ids_e).all()
        assert _counters(rt) == counts_e
        assert rt.stats()["low_computes"] == low_e
        if "resident_quant" in kw:
            assert low_e > 0  # the rule sent some misses to the int4 copies
        if prefetch:
            assert counts_e[1]["guessed"] > 0
        if capacity is not None and capacity < 8:
            assert counts_e[0]["misses"] + low_e > 0  # a cache smaller than N: the step's miss path ran
    finally:
        rt.close()
