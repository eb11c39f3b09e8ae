"""Issue 35's captured decode step (:mod:`expertcache.models.captured`): a batch-1 token's whole step one compiled
graph against a static KV cache, the MoE blocks eager inside it as opaque operators.

Checked against the eager runtime (the reference: the stock transformers forward with a dynamic cache, every
MoE block the runtime's), on an OLMoE-layout model (4 layers, 16 experts, top-4), teacher-forced:

- the logits of every decoded position within float32 rounding (the dense part's sums may be fused
  differently: nothing else changes);
- the routing decisions (recorded ids) and the cache counters (hits, misses, prefetch guesses and reads) equal,
  for original routing and the cache-aware policies, C = N and C < N, prefetch off and on: the MoE blocks and
  the first MoE layer's guess run the same eager code;
- ``generate`` takes the captured step with ``compile`` on and gives the eager tokens; more rows, or a model
  whose layout the step does not take (sliding-window attention), decode eagerly as before;
- a generation longer than the static cache is refused before it writes outside it;
- every registered family's tiny model: the eager logits (DeepSeek-V2's complex rotary frequencies included), or
  for gpt-oss (sinks, sliding windows) the eager path with the eager tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import decode_logits, save_decisive_olmoe
from expertcache.models import SUPPORTED_MODEL_TYPES
from expertcache.models.captured import BUCKET, CapturedDecode, missing_compiler, unsupported_reason
from expertcache.models.tiny import save_tiny, tiny_config
from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.routing import RoutingConfig

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(missing_compiler() is not None, reason="torch.compile needs a C++ compiler (g++)")]

LAYERS, EXPERTS, TOP_K = 4, 16, 4


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory):
    return save_decisive_olmoe(tmp_path_factory.mktemp("olmoe-captured"), LAYERS, EXPERTS, TOP_K)


def _rt(path, *, compile_, policy="original", capacity=None, prefetch=0):
    routing = RoutingConfig() if policy == "original" else RoutingConfig(policy)
    rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", capacity=capacity, readers=0,
                                                            prefetch=prefetch, compile=compile_),
                                        dtype=torch.float32, routing=routing)
    rt.configure(record=True)
    return rt


def _captured_logits(rt, ids_1S, prefill):
    """Logits [1, S - prefill + 1, V]: the prompt's last position, then every teacher-forced token."""
    cap = rt.captured(1, ids_1S.shape[1])
    assert cap is not None
    out = [cap.prefill(ids_1S[:, :prefill])]
    for t in range(prefill, ids_1S.shape[1]):
        out.append(cap.step(ids_1S[:, t:t + 1]))
    return torch.stack(out, dim=1)


def _counters(rt):
    s = rt.stats()
    return {k: s[k] for k in ("hits", "misses", "accesses", "expert_loads")}, s["prefetch"]


@pytest.mark.parametrize("policy,capacity,prefetch", [("original", None, 0),
                                                      pytest.param("original", 6, 2, marks=pytest.mark.slow),
                                                      ("cache-prior", 6, 0), ("max-rank", 5, 2)])
def test_captured_step_gives_the_eager_logits_and_decisions(olmoe_dir, policy, capacity, prefetch):
    ids = torch.randint(3, 128, (1, 14), generator=torch.Generator().manual_seed(3))
    prefill = 4
    eager = _rt(olmoe_dir, compile_=False, policy=policy, capacity=capacity, prefetch=prefetch)
    want = decode_logits(eager, ids, prefill=prefill)[:, prefill - 1:]
    ids_e, counts_e = eager.recorded_ids_TLK(), _counters(eager)
    eager.close()
    rt = _rt(olmoe_dir, compile_=True, policy=policy, capacity=capacity, prefetch=prefetch)
    got = _captured_logits(rt, ids, prefill)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert (rt.recorded_ids_TLK() == ids_e).all()  # every decode step's experts, every layer
    assert _counters(rt) == counts_e
    if prefetch:
        assert counts_e[1]["guessed"] > 0  # the first MoE layer's guess ran inside the graph too
    rt.close()


def test_generate_takes_the_captured_step_and_gives_the_eager_tokens(olmoe_dir):
    """Two generations in a row (the second with a new static cache, the graph of the first, its guards
    skipped; prompts of different lengths) give the eager runtime's tokens and cache counters; the graph is
    compiled once, after the first prefill, and its time is reported apart (``compile_s``)."""
    prompts = [torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (5, 7)]
    out = {}
    for compile_ in (False, True):
        rt = _rt(olmoe_dir, compile_=compile_, policy="cache-prior", capacity=6)
        runs = [rt.generate(p, 9) for p in prompts]
        out[compile_] = [(r["tokens"], r["decode_stats"]["hits"], r["decode_stats"]["misses"]) for r in runs]
        compiled = [r["compile_s"] for r in runs]
        assert (compiled[0] > 0, compiled[1]) == (compile_, 0.0)
        kept = rt.model.__dict__.get("_expertcache_captured", {})
        assert bool(kept) == compile_  # generate compiled a step only with compile on
        rt.close()
    for (ta, *ca), (tb, *cb) in zip(out[False], out[True]):
        assert torch.equal(ta, tb) and ca == cb


def test_batches_and_other_layouts_decode_eagerly(olmoe_dir, tmp_path):
    rt = _rt(olmoe_dir, compile_=True)
    assert rt.captured(2, 10) is None  # two rows: the eager forward
    r = rt.generate(torch.randint(3, 128, (2, 4), generator=torch.Generator().manual_seed(5)), 3)
    assert r["tokens"].shape == (2, 3)
    assert rt.describe()["captured_unsupported"] is None
    rt.close()
    cfg = tiny_config("olmoe")
    cfg.layer_types = ["sliding_attention"] * cfg.num_hidden_layers
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    assert unsupported_reason(model) == "sliding-window layers"
    with pytest.raises(ValueError, match="sliding-window layers"):
        CapturedDecode(model, 8)


def test_a_generation_longer_than_the_static_cache_is_refused(olmoe_dir):
    rt = _rt(olmoe_dir, compile_=True)
    cap = rt.captured(1, 3)
    assert cap.length == BUCKET  # rounded up: one graph for every length up to it
    with pytest.raises(ValueError, match=f"holds {BUCKET} positions; {BUCKET + 1} asked"):
        cap.prefill(torch.ones(1, BUCKET + 1, dtype=torch.long))
    cap.prefill(torch.ones(1, BUCKET - 1, dtype=torch.long))
    cap.step(torch.ones(1, 1, dtype=torch.long))  # the last position
    with pytest.raises(ValueError, match=f"{BUCKET + 1} asked"):
        cap.step(torch.ones(1, 1, dtype=torch.long))
    rt.close()


FAMILY_PARAMS = [a if a in ("deepseek_v2", "gpt_oss") else pytest.param(a, marks=pytest.mark.slow)
                 for a in SUPPORTED_MODEL_TYPES]


@pytest.mark.parametrize("arch", FAMILY_PARAMS)
def test_every_family_takes_the_captured_step_or_decodes_eagerly(arch, tmp_path):
    """Each registered family's tiny model at C = 2: the captured step's logits equal the eager runtime's within
    float32 rounding (DeepSeek-V2 passes its complex rotary frequencies through as they come), or the family is
    one the step does not take (gpt-oss: attention sinks and sliding windows) and ``generate`` with ``compile``
    on decodes eagerly, with the eager tokens."""
    path = save_tiny(arch, tmp_path / arch, seed=4)
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    kw = dict(tier="host", capacity=2, readers=0)
    eager = OffloadedModel.from_pretrained(path, OffloadConfig(**kw), dtype=torch.float32)
    want = decode_logits(eager, ids, prefill=3)[:, 2:]
    want_tokens = eager.generate(ids[:, :4], 5)["tokens"]
    eager.close()
    rt = OffloadedModel.from_pretrained(path, OffloadConfig(compile=True, **kw), dtype=torch.float32)
    why = rt.describe()["captured_unsupported"]
    if arch == "gpt_oss":
        assert why == "attention sinks" and rt.captured(1, 10) is None
        assert torch.equal(rt.generate(ids[:, :4], 5)["tokens"], want_tokens)
    else:
        assert why is None
        cap = rt.captured(1, ids.shape[1])
        got = torch.stack([cap.prefill(ids[:, :3])] + [cap.step(ids[:, t:t + 1]) for t in range(3, ids.shape[1])], 1)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    rt.close()


def test_captured_step_with_a_quantised_dense_part(olmoe_dir):
    """``--quant-dense int8`` (its embedding has no ``.weight``) through the captured step: the eager runtime's
    logits within float32 rounding."""
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    kw = dict(tier="host", capacity=6, readers=0, quant_dense="int8")
    eager = OffloadedModel.from_pretrained(olmoe_dir, OffloadConfig(**kw), dtype=torch.float32)
    want = decode_logits(eager, ids, prefill=3)[:, 2:]
    eager.close()
    rt = OffloadedModel.from_pretrained(olmoe_dir, OffloadConfig(compile=True, **kw), dtype=torch.float32)
    torch.testing.assert_close(_captured_logits(rt, ids, 3), want, atol=2e-5, rtol=2e-5)
    rt.close()


def test_captured_step_against_stock_transformers(olmoe_dir):
    """An independent reference: at C = N with original routing the captured step's logits are stock
    transformers' own (the in-memory model, one forward over the whole sequence) within float32 rounding."""
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(9))
    stock = AutoModelForCausalLM.from_pretrained(olmoe_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = stock(input_ids=ids).logits[:, 3:]
    rt = _rt(olmoe_dir, compile_=True)
    got = _captured_logits(rt, ids, 4)
    rt.close()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
