"""Every term of the memory plan (offload/budget.py), one at a time: a term left out of the runtime's total, of the
process peak, of the ``--memory auto`` check or of a refusal's advice is caught.

The plan written out here independently of budget.py (its module docstring is the contract):

- total (what ``--memory`` budgets) = non-expert + KV + I/O buffers + low-precision copies + (L·C + X) · slot;
- minimum = the same with C = K;
- beside (the process around the total while running) = interpreter + host tier + host cache + page cache +
  overhead;
- loading peak = interpreter + non-expert + loading transient;
- process peak = max(loading peak, beside + total).

For each term: the plan's numbers equal these with only that term large; ``--memory auto`` under a limit takes
the most slots whose process peak fits (one more would not); a container too small for C = K is refused and one
exactly large enough is not; a budget too large for the container is refused with advice (``at most --memory X
(n bytes, C=c)``) that, planned again, fits the limit with exactly c slots. The runtime's wiring of the terms
(KV from the config, the shared slots from ``prefetch``, the page cache from the readers, the host tier from
L · N experts) is checked on a tiny model.
"""

from __future__ import annotations

import re

import pytest
import torch

from expertcache.models.tiny import save_tiny
from expertcache.offload import BudgetError, OffloadConfig, OffloadedModel, plan_memory
from expertcache.offload.budget import AUTO, MINIMUM, RUNTIME_OVERHEAD

MiB = 2**20
L, N, K = 6, 16, 2
#: a small base: every term below is large next to it, so leaving one out moves every number
BASE = dict(non_expert_bytes=40 * MiB, kv_bytes=2 * MiB, expert_bytes=3 * MiB, slot_bytes=3 * MiB + 8192,
            num_layers=L, num_experts=N, top_k=K, extra_slots=1, io_bytes=0, baseline_bytes=100 * MiB,
            load_bytes=5 * MiB, page_cache_bytes=0, host_tier_bytes=0, host_bytes=0, overhead_bytes=16 * MiB,
            low_tier_bytes=0)
#: each term's large value (distinct, none a multiple of the slot)
TERMS = {"non_expert_bytes": 333 * MiB + 17, "kv_bytes": 211 * MiB + 5, "io_bytes": 97 * MiB + 3,
         "low_tier_bytes": 150 * MiB + 11, "extra_slots": 7, "baseline_bytes": 401 * MiB + 7,
         "host_tier_bytes": 257 * MiB + 1, "host_bytes": 123 * MiB + 9, "page_cache_bytes": 77 * MiB + 13,
         "overhead_bytes": 181 * MiB + 19, "slot_bytes": 9 * MiB + 4096}
LOADING = {"load_bytes": 900 * MiB + 21}  # dominates the loading peak


def ref(sizes: dict, slots: int) -> dict:
    """The plan's numbers from the contract above (not from budget.py)."""
    s = sizes
    sb = s["slot_bytes"] or s["expert_bytes"]
    fixed = s["non_expert_bytes"] + s["kv_bytes"] + s["io_bytes"] + s["low_tier_bytes"] + s["extra_slots"] * sb
    total = fixed + s["num_layers"] * slots * sb
    beside = (s["baseline_bytes"] + s["host_tier_bytes"] + s["host_bytes"] + s["page_cache_bytes"]
              + s["overhead_bytes"])
    loading = s["baseline_bytes"] + s["non_expert_bytes"] + s["load_bytes"]
    return dict(total=total, minimum=fixed + s["num_layers"] * s["top_k"] * sb, beside=beside, loading=loading,
                peak=max(loading, beside + total), fixed=fixed, sb=sb)


def _with(term: str, value: int) -> dict:
    return dict(BASE, **{term: value})


ALL = {**TERMS, **LOADING}


@pytest.mark.parametrize("term", list(ALL))
def test_each_term_is_in_the_total_the_minimum_and_the_process_peak(term):
    sizes = _with(term, ALL[term])
    for c in (K, 5, N):
        plan = plan_memory(budget=None, slots=c, **sizes)
        r = ref(sizes, c)
        assert (plan.total, plan.minimum, plan.beside, plan.loading_peak, plan.process_peak) == \
            (r["total"], r["minimum"], r["beside"], r["loading"], r["peak"]), term
        d = plan.to_dict()
        assert d["process_peak"] == r["peak"] and d["total"] == r["total"]
    # the budget's own arithmetic: a budget of exactly the minimum gives K, one byte less is refused
    r = ref(sizes, K)
    assert plan_memory(budget=MINIMUM, slots=None, **sizes).slots == K
    assert plan_memory(budget=r["minimum"], slots=None, **sizes).slots == K
    with pytest.raises(BudgetError, match=rf"\({r['minimum']} bytes\)"):
        plan_memory(budget=r["minimum"] - 1, slots=None, **sizes)
    # a budget of C slots exactly, and one byte short of C + 1
    c = 5
    exact = r["fixed"] + L * c * r["sb"]
    assert plan_memory(budget=exact, slots=None, **sizes).slots == c
    assert plan_memory(budget=exact + L * r["sb"] - 1, slots=None, **sizes).slots == c
    assert plan_memory(budget=exact + L * r["sb"], slots=None, **sizes).slots == c + 1


def _limit_for(sizes: dict, c: int) -> int:
    """A limit between the process peak at C = c and at c + 1 (c < N)."""
    return (ref(sizes, c)["peak"] + ref(sizes, c + 1)["peak"]) // 2


def _limits_around(sizes: dict, c: int) -> tuple[int, ...]:
    """The boundaries of C = c: its process peak exactly, halfway to c + 1's, one byte short of c + 1's."""
    return ref(sizes, c)["peak"], _limit_for(sizes, c), ref(sizes, c + 1)["peak"] - 1


@pytest.mark.parametrize("term", list(ALL))
def test_auto_takes_the_most_slots_whose_process_fits_with_each_term(term):
    sizes = _with(term, ALL[term])
    for limit in [lim for c in (K, 5, N - 1) for lim in _limits_around(sizes, c)] + [ref(sizes, N)["peak"]]:
        if limit < ref(sizes, K)["peak"]:  # the loading peak dominates: refused, the test below
            continue
        plan = plan_memory(budget=AUTO, slots=None, limit=limit, **sizes)
        assert plan.process_peak == ref(sizes, plan.slots)["peak"] <= limit, term
        assert plan.slots == N or ref(sizes, plan.slots + 1)["peak"] > limit, term
        assert plan.budget == limit - ref(sizes, K)["beside"], term  # the budget is what the process leaves


@pytest.mark.parametrize("term", list(ALL))
def test_a_container_below_the_process_at_c_equals_k_is_refused_and_one_at_it_is_not(term):
    sizes = _with(term, ALL[term])
    need = ref(sizes, K)["peak"]
    for budget in (AUTO, MINIMUM):
        with pytest.raises(BudgetError, match=rf"needs at least .*\({need} bytes\)"):
            plan_memory(budget=budget, slots=None, limit=need - 1, **sizes)
        plan = plan_memory(budget=budget, slots=None, limit=need, **sizes)
        assert plan.process_peak == need == ref(sizes, plan.slots)["peak"]
        # C = K exactly, unless the loading peak leaves room for more slots beside the running process
        assert plan.slots == K or (budget == AUTO and ref(sizes, K)["loading"] == need)
    if term == "load_bytes":  # the message says why: the loading peak is the larger
        with pytest.raises(BudgetError, match="loading peaks at"):
            plan_memory(budget=AUTO, slots=None, limit=need - 1, **sizes)


ADVICE = re.compile(r"at most --memory .* \((\d+) bytes, C=(\d+)\) fits")


@pytest.mark.parametrize("term", list(ALL))
def test_the_refusals_advice_planned_again_fits(term):
    """A budget (or a slot count) too large for the container: the advised budget, planned again under the same
    limit, fits with exactly the advised C, and C + 1 would not."""
    sizes = _with(term, ALL[term])
    for c, limit in [(c, lim) for c in (K, 5, N - 2) for lim in _limits_around(sizes, c)]:
        if ref(sizes, N)["peak"] <= limit or limit < ref(sizes, K)["peak"]:  # the loading peak dominates
            continue
        for kw in (dict(budget=ref(sizes, N)["total"], slots=None), dict(budget=None, slots=N)):
            with pytest.raises(BudgetError) as exc:
                plan_memory(limit=limit, **kw, **sizes)
            m = ADVICE.search(str(exc.value))
            assert m, str(exc.value)
            fits, advised = int(m.group(1)), int(m.group(2))
            plan = plan_memory(budget=fits, slots=None, limit=limit, **sizes)
            assert plan.process_peak <= limit and plan.slots == advised, term
            assert advised == max(x for x in range(N + 1) if ref(sizes, x)["peak"] <= limit), term
            assert plan.process_peak == ref(sizes, advised)["peak"], term


# -- the runtime's wiring of the terms -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny("olmoe", tmp_path_factory.mktemp("plan-terms") / "tiny", seed=4)


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path):
    torch.set_num_threads(1)
    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("EXPERTCACHE_CGROUP_ROOT", str(tmp_path / "no-cgroup"))  # no limit


@pytest.mark.parametrize("kw", [dict(tier="disk", io="cached", readers=3, prefetch=2, context=48, batch=2),
                                dict(tier="disk", io="direct", readers=2, prefetch=0, context=16, batch=1),
                                dict(tier="host", readers=0, prefetch=1, context=32, batch=1)],
                         ids=["buffered", "direct", "host"])
def test_the_runtime_fills_each_term_from_the_config(tiny, kw):
    rt = OffloadedModel.from_pretrained(tiny, OffloadConfig(capacity=3, **kw), dtype=torch.float32)
    try:
        p, cfg = rt.plan, rt.model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        assert p.kv_bytes == 2 * cfg.num_hidden_layers * heads * head_dim * kw["context"] * kw["batch"] * 4
        assert p.extra_slots == 1 + kw["prefetch"]  # one scratch slot + the prefetch spares
        assert p.slots == 3 and p.num_layers == len(rt.layers)
        assert p.overhead_bytes == RUNTIME_OVERHEAD and p.baseline_bytes > 0
        buffered = kw["tier"] == "disk" and kw.get("io") != "direct"
        assert p.page_cache_bytes == (kw["readers"] * p.slot_bytes if buffered else 0)
        assert p.host_tier_bytes == (len(rt.layers) * rt.num_experts * rt.expert_bytes if kw["tier"] == "host" else 0)
        # the dense weights as they are held: every parameter and buffer outside the experts, each storage once
        seen, dense = set(), 0
        for name, t in list(rt.model.named_parameters(remove_duplicate=False)) + list(rt.model.named_buffers()):
            if ".experts." in f".{name}" or t.data_ptr() in seen or t.device.type == "meta":
                continue
            seen.add(t.data_ptr())
            dense += t.numel() * t.element_size()
        assert p.non_expert_bytes == dense
        got = dict(BASE, **{k: getattr(p, k) for k in BASE if hasattr(p, k)})
        assert (p.total, p.process_peak) == (ref(got, p.slots)["total"], ref(got, p.slots)["peak"])
    finally:
        rt.close()


# -- reading the container's limit: which lines count ---------------------------------------------


def _tree(root, proc_cgroup: str, files: dict):
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    (root / "proc/self/cgroup").write_text(proc_cgroup)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    return root


def test_only_the_unified_line_reads_memory_max(tmp_path):
    """v2's line is ``0::/path`` (hierarchy 0, no controllers); a v1 line of another controller is not it, even
    with hierarchy id 0 and a memory.max file at its path."""
    from expertcache.offload.budget import cgroup_memory_limit

    files = {"sys/fs/cgroup/x/memory.max": str(1 << 30)}
    assert cgroup_memory_limit(_tree(tmp_path / "a", "0:cpu:/x\n", files)) is None
    assert cgroup_memory_limit(_tree(tmp_path / "b", "0::/x\n", files)) == 1 << 30


def test_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    from expertcache.offload.budget import cgroup_memory_limit

    files = {"sys/fs/cgroup/memory.max": "max", "sys/fs/cgroup/a/memory.max": str(3 << 20),
             "sys/fs/cgroup/a/b/memory.max": str(5 << 20), "sys/fs/cgroup/a/b/c/memory.max": "max"}
    assert cgroup_memory_limit(_tree(tmp_path, "0::/a/b/c\n", files)) == 3 << 20
