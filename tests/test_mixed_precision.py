"""Precision as a tier (issue 37, ``--resident-quant int4``): the per-miss rule against a hand computation; a rule
that never picks low precision is today's runtime bit for bit; one that always does is the all-int4 model; the
counters (full-precision hits, low-precision computes, loads) follow an independent LRU replay of the
routing plus the rule, promotion included; the plan counts the sidecar's bytes; cache-prior-cost prices the
third tier; bad flags are one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import oracles
from conftest import decode_logits
from expertcache.cli.main import main
from expertcache.models.tiny import save_tiny
from expertcache.offload import BudgetError, OffloadConfig, OffloadedModel, read_header
from expertcache.routing import RoutingConfig
from expertcache.routing.precision import NEVER, PrecisionRule, serve_low, tier_costs

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("olmoe", tmp_path_factory.mktemp("mixed") / "olmoe", seed=4)


def _rt(path, capacity=None, *, low=True, routing=None, rule=None, quant=None, memory=None):
    rule = rule or PrecisionRule()
    offload = OffloadConfig(tier="host", capacity=capacity, memory=memory, quant=quant,
                            resident_quant="int4" if low else None, low_threshold=rule.threshold,
                            load_budget=rule.budget, promote_after=rule.promote, low_cost=rule.cost)
    return OffloadedModel.from_pretrained(path, offload, dtype=torch.float32, routing=routing or RoutingConfig())


def _ids(n=20, seed=1):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


# -- the rule, by hand ---------------------------------------------------------------------------------


def test_rule_threshold_by_hand():
    rule = PrecisionRule(threshold=0.2)
    # order by descending weight; the resident one is a hit whatever its weight
    got = serve_low([5, 1, 7, 3], [0.5, 0.25, 0.15, 0.1], [False, False, True, False], rule, expert_bytes=100)
    assert got == [False, False, False, True]
    assert serve_low([5, 1], [0.5, 0.2], [False, False], rule, expert_bytes=100) == [False, False]  # not below
    assert serve_low([5, 1], [0.5, 0.1], [False, False], NEVER, expert_bytes=100) == [False, False]


def test_rule_budget_by_hand():
    # 250 bytes a token, 100 a load: the two heaviest misses load, the third does not fit; hits spend nothing
    rule = PrecisionRule(budget=250)
    got = serve_low([4, 2, 9, 6, 8], [0.4, 0.3, 0.2, 0.05, 0.05], [False, True, False, False, False], rule,
                    expert_bytes=100)
    assert got == [False, False, False, True, True]
    # two tokens in the step: twice the budget
    got = serve_low([4, 9, 6, 8, 1, 0], [0.4, 0.3, 0.2, 0.1, 0.1, 0.1], [False] * 6, rule, expert_bytes=100,
                    tokens=2)
    assert got == [False] * 5 + [True]
    assert serve_low([4, 9], [0.9, 0.8], [False, False], PrecisionRule(budget=0), expert_bytes=100) == [True, True]


def test_rule_promotion_by_hand():
    # every miss low, except an expert already served low twice (promote=2): loaded, spending the budget
    rule = PrecisionRule(threshold=2.0, promote=2)
    got = serve_low([3, 4, 5], [0.5, 0.3, 0.2], [False, False, False], rule, expert_bytes=1, low_served=[1, 2, 7])
    assert got == [True, False, False]
    assert PrecisionRule(threshold=2.0).active and not NEVER.active


@pytest.mark.parametrize("bad", [dict(threshold=-0.1), dict(threshold=float("nan")), dict(budget=-1),
                                 dict(promote=-2), dict(promote=1.5), dict(cost=1.5)])
def test_rule_refuses_bad_parameters(bad):
    with pytest.raises(ValueError):
        PrecisionRule(**bad)


def test_tier_costs_by_hand():
    load = np.array([0.0, 1.0, 0.4, 1.0], np.float32)  # resident, disk, host cache, disk
    assert tier_costs(load, PrecisionRule(threshold=0.1, cost=0.3)).tolist() == pytest.approx([0.0, 0.3, 0.3, 0.3])
    assert tier_costs(load, PrecisionRule(threshold=0.1)) is load  # unpriced: the load cost
    assert tier_costs(load, PrecisionRule(cost=0.3)) is load  # a rule that never picks low precision


# -- against the runtimes ---------------------------------------------------------------------------


@pytest.mark.parametrize("routing", [RoutingConfig(), RoutingConfig("cache-prior", lam=0.5)])
def test_threshold_zero_is_todays_runtime(tiny, routing):
    ids = _ids()
    base = _rt(tiny, 3, low=False, routing=routing)
    mixed = _rt(tiny, 3, routing=routing)
    a, b = decode_logits(base, ids, prefill=4), decode_logits(mixed, ids, prefill=4)
    assert torch.equal(a, b)
    s0, s1 = base.stats(), mixed.stats()
    assert (s1["hits"], s1["misses"], s1["low_computes"]) == (s0["hits"], s0["misses"], 0)


def test_every_expert_low_is_the_all_int4_model(tiny):
    ids = _ids(seed=2)
    int4 = _rt(tiny, None, low=False, quant="int4")  # C = N, every expert int4 in its slot
    assert int4.capacity == int4.num_experts
    mixed = _rt(tiny, 2, rule=PrecisionRule(threshold=2.0))  # every miss low, none ever loaded
    full = _rt(tiny, None, low=False)
    lq, lm, lf = (decode_logits(rt, ids, prefill=5) for rt in (int4, mixed, full))
    torch.testing.assert_close(lm, lq, rtol=1e-5, atol=1e-5)
    assert (lm - lf).abs().max() > 1e-4  # and int4 is not the full-precision model
    s = mixed.stats()
    assert s["accesses"] == 0 and s["low_computes"] > 0


@pytest.mark.parametrize("rule, routing", [
    (PrecisionRule(threshold=0.3), RoutingConfig()),
    (PrecisionRule(threshold=2.0, promote=2), RoutingConfig()),
    (PrecisionRule(budget=1), RoutingConfig("cache-prior", lam=0.6)),  # budget: one expert's bytes a token
    (PrecisionRule(threshold=0.25, promote=1), RoutingConfig("cache-prior-cost", lam=0.5)),
])
def test_counters_equal_an_lru_replay_with_the_rule(tiny, rule, routing):
    """Per layer, replay the routed ids (router observer) through the LRU oracle, deciding each miss by hand:
    below the threshold or past the budget → low precision (not seen by the cache), promoted after
    ``promote`` low serves since its last load."""
    import dataclasses

    cap = 3
    rt = _rt(tiny, cap, routing=routing)
    if rule.budget is not None:  # in experts: bytes of that many full-precision loads
        rule = dataclasses.replace(rule, budget=rule.budget * rt.expert_bytes)
    rt.configure(precision=dataclasses.replace(rule, cost=0.2))  # a price for cost-aware rows; decisions ignore it
    seen: list = []
    rt.add_router_observer(lambda ev: seen.append((ev.layer, ev.ids[0].tolist(), ev.weights[0].tolist())))
    decode_logits(rt, _ids(24, seed=3), prefill=1)
    layers = rt.stats()["per_layer_misses"]
    lru = {li: [] for li in range(len(layers))}
    served = {li: {} for li in range(len(layers))}
    hits = {li: 0 for li in lru}
    misses = {li: 0 for li in lru}
    low = {li: 0 for li in lru}
    for li, ids, ws in seen:
        left = None if rule.budget is None else rule.budget
        load = []
        for e, w in zip(ids, ws):
            if e in lru[li]:
                load.append(e)
                continue
            promoted = rule.promote and served[li].get(e, 0) >= rule.promote
            fits = left is None or left >= rt.expert_bytes
            if not promoted and (w < rule.threshold or not fits):
                low[li] += 1
                served[li][e] = served[li].get(e, 0) + 1
                continue
            served[li].pop(e, None)
            if left is not None:
                left -= rt.expert_bytes
            load.append(e)
        if load:
            h = oracles.lru_step(lru[li], load, cap)
            hits[li] += sum(h)
            misses[li] += len(h) - sum(h)
    per = rt.cache_stats()
    assert [s.hits for s in per] == [hits[li] for li in lru]
    assert [s.misses for s in per] == [misses[li] for li in lru]
    assert rt.stats()["per_layer_low_computes"] == [low[li] for li in lru]
    assert sum(low.values()) > 0 and sum(misses.values()) > 0


def test_plan_counts_the_sidecars_bytes(tiny):
    base = _rt(tiny, 3, low=False)
    mixed = _rt(tiny, 3)
    side = mixed.low.path
    blobs = sum(t.nbytes for k, t in read_header(side).items() if k.endswith(".qblob"))
    assert mixed.plan.low_tier_bytes == blobs == sum(r.numel() for r in mixed.low.rows)
    assert mixed.plan.total - base.plan.total == blobs
    # a budget of exactly the mixed minimum runs at C = K; one byte less is refused naming the term
    minimum = mixed.plan.minimum
    assert minimum - base.plan.minimum == blobs
    assert _rt(tiny, memory=minimum).capacity == mixed.top_k
    with pytest.raises(BudgetError, match="low-precision copies"):
        _rt(tiny, memory=minimum - 1)


def test_cost_aware_routing_reads_the_low_precision_price(tiny):
    rt = _rt(tiny, 3, rule=PrecisionRule(threshold=0.2, cost=0.25), routing=RoutingConfig("cache-prior-cost", lam=0.5))
    decode_logits(rt, _ids(6), prefill=1)
    for li, st in enumerate(rt.states):
        cost = rt.miss_costs(li)
        resident = st.cache.resident_array()
        assert cost[resident].tolist() == [0.0] * int(resident.sum())
        assert cost[~resident].tolist() == pytest.approx([0.25] * int((~resident).sum()))


def test_a_low_precision_rule_needs_the_tier(tiny):
    rt = _rt(tiny, 3, low=False)
    with pytest.raises(ValueError, match="resident-quant"):
        rt.configure(precision=PrecisionRule(threshold=0.5))


@pytest.mark.parametrize("argv, culprit", [
    (["--low-threshold", "0.3"], "--resident-quant"),
    (["--resident-quant", "int4", "--low-threshold", "-1"], "--low-threshold"),
    (["--resident-quant", "int4", "--load-budget", "lots"], "--load-budget"),
    (["--resident-quant", "int4", "--low-cost", "2"], "--low-cost"),
    (["--resident-quant", "int4", "--quant", "int4"], "--resident-quant"),
    (["--resident-quant", "int2"], "--resident-quant"),
])
def test_bad_flags_are_one_line_errors(tiny, capsys, argv, culprit):
    code = main(["generate", "--model", str(tiny), "--tier", "host", "--cache-experts", "2", "--max-new-tokens", "2",
                 *argv, "1 2 3"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and "Traceback" not in err and len(errors) == 1 and culprit in errors[0], err


def test_step_events_name_the_low_precision_experts(tiny):
    """The step observers see each step's int4 computes (the live view colours them): per layer they add up to
    the runtime's counter, and with the served ids they are exactly the routed ids of the step."""
    rt = _rt(tiny, 2, rule=PrecisionRule(threshold=0.3, promote=2))
    events, routed = [], []
    rt.add_step_observer(events.append)
    rt.add_router_observer(lambda ev: routed.append((ev.layer, sorted(ev.ids[0].tolist()))))
    decode_logits(rt, _ids(16, seed=5), prefill=1)
    demand = [ev for ev in events if ev.kind == "demand"]
    assert [(ev.layer, sorted(ev.order + ev.low)) for ev in demand] == routed
    assert all(not set(ev.order) & set(ev.low) for ev in demand)
    per = [sum(len(ev.low) for ev in demand if ev.layer == li) for li in range(len(rt.layers))]
    assert per == rt.stats()["per_layer_low_computes"] and sum(per) > 0
    assert any(not ev.order for ev in demand)  # a step of int4 computes only is still reported


def test_a_prefetched_expert_is_served_at_full_precision(tiny):
    """With every miss at 4 bits, the only full-precision loads are the next-layer guesses already in a spare
    slot (no demand read): the demand misses equal the guesses used."""
    offload = OffloadConfig(tier="host", capacity=2, prefetch=2, resident_quant="int4", low_threshold=2.0)
    rt = OffloadedModel.from_pretrained(tiny, offload, dtype=torch.float32)
    decode_logits(rt, _ids(16, seed=6), prefill=1)
    s = rt.stats()
    assert s["misses"] == s["prefetch"]["used"] > 0 and s["low_computes"] > 0


def test_closed_loop_scoring_is_the_stock_models(tmp_path):
    """bench_mixed.py's closed loop (each text token by token through the offloaded runtime at C < N, the caches
    carried across chunks and questions), full precision with original routing: its perplexity NLL is the stock
    model's cross-entropy over each chunk, its MMLU predictions and right-letter log-probabilities the stock
    model's letter scoring of each prompt (computed here from the stock logits, not through the task)."""
    from transformers import AutoModelForCausalLM

    from expertcache.eval.synthetic import save_tiny_with_tokenizer, write_toy_data
    from expertcache.eval.tasks import MMLUTask
    from expertcache.models.loader import load_tokenizer_checked
    from expertcache.offload.bench import closed_loop_mmlu, closed_loop_nll

    model_dir = save_tiny_with_tokenizer("olmoe", tmp_path / "model")
    data_dir = write_toy_data(tmp_path / "data")
    task = MMLUTask(load_tokenizer_checked(model_dir), context=256, data_dir=data_dir, limit=4)
    stock = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rt = OffloadedModel.from_pretrained(model_dir, OffloadConfig(tier="host", capacity=2), dtype=torch.float32)
    assert rt.capacity < rt.num_experts

    res = closed_loop_mmlu(rt, task)
    assert rt.stats()["misses"] > 0  # the cache was exercised
    with torch.no_grad():
        expected = [torch.log_softmax(stock(torch.tensor([ids])).logits[0, -1], -1) for ids in task.prompts]
    assert res["predictions"] == [int(lp[task.letter_ids].argmax()) for lp in expected]
    assert res["correct"] == sum(int(lp[task.letter_ids].argmax()) == a for lp, a in zip(expected, task.answers))
    mean = sum(float(lp[task.letter_ids[a]]) for lp, a in zip(expected, task.answers)) / len(task)
    assert res["mean_answer_loglik"] == pytest.approx(mean, abs=1e-4)

    chunks_NS = _ids(48, seed=5).view(3, 16)
    nll, count = closed_loop_nll(rt, chunks_NS)
    with torch.no_grad():
        ce = sum(float(torch.nn.functional.cross_entropy(stock(c[None]).logits[0, :-1], c[1:], reduction="sum"))
                 for c in chunks_NS)
    assert count == 3 * 15 and nll == pytest.approx(ce, rel=1e-5)


def test_paired_se_of_the_report_by_hand():
    """benchmarks/mixed_report.py's resolution of a perplexity change: the standard error, over the chunks both rows
    scored, of the per-token NLL difference (computed here with numpy); none without per-chunk NLLs."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("mixed_report", Path(__file__).parents[1] / "benchmarks" /
                                                  "mixed_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    base = dict(chunk_nll=[300.0, 330.0, 310.0, 320.0], tokens=4 * 60)
    row = dict(chunk_nll=[303.0, 330.0, 316.0, 321.0], tokens=4 * 60)
    d = (np.array(row["chunk_nll"]) - np.array(base["chunk_nll"])) / 60
    assert report.paired_se(row, base) == pytest.approx(d.std(ddof=1) / 2)
    assert report.paired_se(dict(tokens=240), base) is None
    assert report.paired_se(dict(chunk_nll=[1.0], tokens=60), dict(chunk_nll=[2.0], tokens=60)) is None
