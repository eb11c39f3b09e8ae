"""Issue 35's captured decode step (:mod:`expertcache.models.captured`): a batch-1 token's whole step one compiled
graph against a static KV cache, the MoE blocks traced into it, the host's decisions custom operators inside it and
the experts computed in the graph from their slots.

Checked against the eager runtime (the reference: the stock transformers forward with a dynamic cache, every
MoE block the runtime's), on an OLMoE-layout model (4 layers, 16 experts, top-4), teacher-forced:

- the logits of every decoded position within float32 rounding (the dense part's and the in-graph expert
  products' sums may be fused differently: nothing else changes);
- the routing decisions (recorded ids) and the cache counters (hits, misses, prefetch guesses and reads,
  low-precision computes) equal, for original routing and the cache-aware policies, C = N, C < N and C < K
  (a scratch slot read twice: those experts computed beside the graph), prefetch off and on, reads in flight on
  two reader threads from the disk tier, int8 experts (the eager products as one operator) and resident int4
  copies: the operators run the same eager host code;
- the in-graph products (:func:`~expertcache.offload.step.inline_product`) against the family's own one-expert
  MLP; a MoE block with a forward hook stays one opaque operator and its hook runs;
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


def _rt(path, *, compile_, policy="original", capacity=None, prefetch=0, **kw):
    routing = RoutingConfig() if policy == "original" else RoutingConfig(policy)
    kw = dict(dict(tier="host", readers=0), **kw)
    rt = OffloadedModel.from_pretrained(path, OffloadConfig(capacity=capacity, prefetch=prefetch, compile=compile_,
                                                            **kw),
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


@pytest.mark.parametrize("policy,capacity,prefetch,kw", [
    ("original", None, 0, {}),
    pytest.param("original", 6, 2, {}, marks=pytest.mark.slow),
    ("cache-prior", 6, 0, {}), ("max-rank", 5, 2, {}),
    # C < K: each step reads a scratch slot twice (those experts are computed eagerly, beside the graph's)
    ("original", 2, 0, {}),
    # reads in flight on two reader threads; the disk tier's packed placement (O_DIRECT through the bounce buffer)
    pytest.param("cache-prior", 6, 0, dict(tier="disk", readers=2), marks=pytest.mark.slow),
    # int8 experts: not computed in the graph (the eager products, one operator per MoE block)
    pytest.param("cache-prior", 6, 0, dict(quant="int8"), marks=pytest.mark.slow),
    # resident int4 copies: the misses the rule picks are computed from them beside the graph (its `rest`)
    pytest.param("original", 4, 0, dict(resident_quant="int4", low_threshold=2.0), marks=pytest.mark.slow)])
def test_captured_step_gives_the_eager_logits_and_decisions(olmoe_dir, policy, capacity, prefetch, kw):
    ids = torch.randint(3, 128, (1, 14), generator=torch.Generator().manual_seed(3))
    prefill = 4
    eager = _rt(olmoe_dir, compile_=False, policy=policy, capacity=capacity, prefetch=prefetch, **kw)
    want = decode_logits(eager, ids, prefill=prefill)[:, prefill - 1:]
    ids_e, counts_e = eager.recorded_ids_TLK(), _counters(eager)
    eager.close()
    rt = _rt(olmoe_dir, compile_=True, policy=policy, capacity=capacity, prefetch=prefetch, **kw)
    assert rt.describe()["captured_experts"] == ("eager" if kw.get("quant") else "graph")
    got = _captured_logits(rt, ids, prefill)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert (rt.recorded_ids_TLK() == ids_e).all()  # every decode step's experts, every layer
    assert _counters(rt) == counts_e
    assert rt.stats()["low_computes"] == eager.stats()["low_computes"]
    assert rt.stats()["low_computes"] > 0 or "resident_quant" not in kw
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
        notices = []  # on_compile: called once, just before the compilation (the CLI's notice)
        runs = [rt.generate(p, 9, on_compile=lambda i=i: notices.append(i)) for i, p in enumerate(prompts)]
        out[compile_] = [(r["tokens"], r["decode_stats"]["hits"], r["decode_stats"]["misses"]) for r in runs]
        compiled = [r["compile_s"] for r in runs]
        assert (compiled[0] > 0, compiled[1]) == (compile_, 0.0)
        assert notices == ([0] if compile_ else [])
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


def test_captured_step_with_a_quantised_dense_part(olmoe_dir, monkeypatch):
    """``--quant-dense int8`` (its embedding has no ``.weight``) through the captured step: the eager runtime's
    logits within float32 rounding (both on ``_weight_int8pack_mm``, what ``--compile`` runs: the eager runtime
    would otherwise take FBGEMM's int8-activation kernel, quant.dense_int8_kernel)."""
    monkeypatch.setenv("EXPERTCACHE_DENSE_INT8_KERNEL", "int8pack")
    monkeypatch.setenv("EXPERTCACHE_EMBEDDING", "ram")  # the eager one's int8 embedding too (--compile holds it)
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


def test_graph_products_against_the_family_mlp(olmoe_dir):
    """:func:`inline_product` (the in-graph expert products), eager and compiled, against the family's own
    one-expert MLP (``expert_mlp``: two ``mv``) summed with the routing weights, on the runtime's arena: positions
    with slot -1 contribute nothing even where that slot holds NaN, and a repeated slot counts once per position."""
    rt = _rt(olmoe_dir, compile_=True, capacity=6)
    views, act = rt.graph_products(0)
    gate_up, down = views
    g = torch.Generator().manual_seed(2)
    n = gate_up.shape[0]
    for s_ in range(n):  # every slot's matrices set (the arena is zeros until a read lands)
        gate_up[s_].copy_(torch.randn(gate_up.shape[1:], generator=g))
        down[s_].copy_(torch.randn(down.shape[1:], generator=g))
    gate_up[3].fill_(float("nan"))
    x_TD = torch.randn(1, gate_up.shape[2], generator=g)
    slot_K = torch.tensor([5, -1, 0, 5])
    w_TK = torch.rand(1, 4, generator=g)
    mlp = rt._mlps[0]  # the family's one-expert MLP (offload/experts.py expert_mlp)
    want = sum(w_TK[0, k] * mlp(x_TD, (gate_up[s_], down[s_])) for k, s_ in enumerate(slot_K.tolist()) if s_ >= 0)
    from expertcache.offload.step import inline_product

    got = inline_product(views, x_TD, slot_K, w_TK, act)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    compiled = torch.compile(inline_product, dynamic=False)
    torch.testing.assert_close(compiled(views, x_TD, torch.tensor([-1, 3, 0, 5]).where(
        torch.tensor([False, False, True, True]), -1), w_TK, act),
        w_TK[0, 2] * mlp(x_TD, (gate_up[0], down[0])) + w_TK[0, 3] * mlp(x_TD, (gate_up[5], down[5])),
        atol=1e-5, rtol=1e-5)
    rt.close()


def test_a_hooked_moe_block_stays_opaque_and_its_hook_runs(olmoe_dir):
    """A forward hook on a MoE block would be traced into the graph (its state baked in): the step keeps such
    blocks opaque (``expertcache::moe_block``), the hook runs once per token and block, and the logits are the
    eager ones."""
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(4))
    eager = _rt(olmoe_dir, compile_=False, capacity=6)
    want = decode_logits(eager, ids, prefill=3)[:, 2:]
    eager.close()
    rt = _rt(olmoe_dir, compile_=True, capacity=6)
    calls = []
    rt.layers[1].block.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    cap = rt.captured(1, ids.shape[1])
    assert not cap._traced
    got = _captured_logits(rt, ids, 3)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert len(calls) == 1 + ids.shape[1] - 3  # the prefill, then each token (the compiling call runs no block)
    rt.close()


def test_cli_generate_compile_says_it_is_compiling_before_the_pause(olmoe_dir, capsys):
    """``generate --compile``: one stderr line announces the compilation before it starts (a first run is
    otherwise silent for up to a minute after the prompt), and the summary reports its time apart."""
    from expertcache.cli.main import main

    assert main(["generate", "--model", str(olmoe_dir), "--tier", "host", "--compile", "--max-new-tokens", "3",
                 "--seed", "0", "5 6 7"]) == 0
    err = capsys.readouterr().err.splitlines()
    notice = [i for i, line in enumerate(err) if "compiling the decode step" in line]
    summary = [i for i, line in enumerate(err) if "decode step compiled in" in line]
    assert len(notice) == 1 and len(summary) == 1 and notice[0] < summary[0], err
