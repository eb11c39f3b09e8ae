"""A routing policy and an eviction rule added through the registries alone (issue 25).

``toy-max-rank`` is Max-Rank (001 Alg. 1) registered under a new name with the same kernel code and strength
field; ``toy-lru`` is an ``LRUCache`` subclass registered under a new name. Neither touches any other module:
the test registers them and runs them through every entry point -- ``RoutingConfig`` and the kernel's dispatch,
``simulate``, the sweep (plan, grid, rows), the closed-loop ``evaluate``, the offloaded runtime, the CLI
(``simulate``, ``sweep``, ``eval``, ``generate``/``bench`` flags and help), the lm-eval adapter, the live
view's choices and replay, the miss-rate controller and report colours. The expectation for each is
independent of the registration: the results of the policy and rule each one copies, computed under their own
names. A policy whose kernel code has no key rule fails at registration, or at first use when it bypasses it.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch

from expertcache.cache import (EVICTION_POLICIES, EVICTIONS, LIVE_EVICTIONS, EvictionRule, LRUCache, make_cache,
                               register_eviction, registered_eviction, unregister_eviction)
from expertcache.cli.main import build_parser, main
# imported before any registration: the names are live views, not copies
from expertcache.routing import POLICIES, STRENGTH, PolicySpec, RoutingConfig, registered_policy
from expertcache.routing.registry import (CACHE_PRIOR, CODES, DEFAULT_TOP_J, SPECS, STEERABLE, policy_colour,
                                          register_policy, unregister_policy)
from expertcache.sim import simulate
from test_trace_sim import make_trace

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


class ToyLRU(LRUCache):
    """LRU under another name: the victim score of code LRU, nothing else."""


TOY = PolicySpec("toy-max-rank", SPECS["max-rank"].code, "m")
TOY_RULE = EvictionRule("toy-lru", ToyLRU)
#: a steerable copy of Cache-Prior (for the controller), and a copy of ERAS biasing (profile-reading)
TOY_CP = PolicySpec("toy-cache-prior", SPECS["cache-prior"].code, "lam", running_delta=True, steer=(1e-3, 1.0, 0.2))
TOY_EB = PolicySpec("toy-eras-bias", SPECS["eras-bias"].code, "beta", top_j=0, needs_profile=True)
#: toy name -> the name it copies
COPIES = {"toy-max-rank": "max-rank", "toy-cache-prior": "cache-prior", "toy-eras-bias": "eras-bias",
          "toy-lru": "lru"}


@pytest.fixture
def toys():
    """The toy policies and rule, registered for one test only (every other test sees the built-ins alone)."""
    with contextlib.ExitStack() as stack:
        for s in (TOY, TOY_CP, TOY_EB):
            stack.enter_context(registered_policy(s))
        stack.enter_context(registered_eviction(TOY_RULE))
        yield
    assert "toy-max-rank" not in POLICIES and "toy-lru" not in EVICTION_POLICIES


def _as_copied(value):
    """``value`` (a row, a config) with every toy name replaced by the name it copies."""
    if isinstance(value, dict):
        return {k: _as_copied(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_as_copied(v) for v in value]
    if isinstance(value, str):  # a name, or a label such as "toy-max-rank(m=4,J=1)"
        for toy, orig in COPIES.items():
            value = value.replace(toy, orig)
    return value


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    return str(make_trace(t=60, l=2, e=8, k=2, seed=3).save(tmp_path_factory.mktemp("tr") / "t.trace",
                                                              logits_dtype="float32"))


def _cli(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


# -- the registration API ---------------------------------------------------------------------------------------

def test_registration_is_seen_through_names_imported_before_it(toys):
    assert "toy-max-rank" in POLICIES and POLICIES[-3:] == ("toy-max-rank", "toy-cache-prior", "toy-eras-bias")
    assert STRENGTH["toy-max-rank"] == "m" and DEFAULT_TOP_J["toy-max-rank"] == 1
    assert CODES["toy-max-rank"] == CODES["max-rank"]
    assert "toy-cache-prior" in CACHE_PRIOR and STEERABLE["toy-cache-prior"] == (1e-3, 1.0, 0.2)
    assert "toy-lru" in EVICTION_POLICIES and "toy-lru" in LIVE_EVICTIONS and EVICTIONS["toy-lru"] is TOY_RULE
    assert isinstance(make_cache("toy-lru", 8, 4), ToyLRU)
    rc = RoutingConfig("toy-max-rank", m=5)
    assert rc.top_j == 1 and rc.cache_aware and rc.label() == "toy-max-rank(m=5,J=1)"
    from expertcache.routing import kernels

    ip, _ = kernels.pack("toy-max-rank", 1, m=5)
    assert ip[0] == SPECS["max-rank"].code


def test_bad_registrations_are_refused_and_change_nothing():
    before, evs = tuple(POLICIES), tuple(EVICTION_POLICIES)
    bad = [
        (SPECS["max-rank"], "already registered"),
        (PolicySpec("toy", 9, "lam"), "kernel code 9 has no key rule"),
        (PolicySpec("toy", None, None), "code None"),
        (PolicySpec("toy", True, "m"), "kernel code True"),
        (PolicySpec("toy", 1, "lam"), "reads the strength 'm'"),
        (PolicySpec("toy", 0, "lam"), "running_delta must be True"),
        (PolicySpec("toy", 1, "m", needs_probs=True), "needs_probs must be False"),
        (PolicySpec("a,b", 1, "m"), "policy name"),
        (PolicySpec("Toy", 1, "m"), "policy name"),
        (PolicySpec("toy", 1, "m", top_j=-1), "top_j"),
        (PolicySpec("toy", 1, "m", steer=(1e-3, 1.0, 0.2)), "cannot be steered"),
        (PolicySpec("toy", 0, "lam", running_delta=True, steer=(0.5, 1.0, 0.2)), "steer must be"),
        (PolicySpec("toy", 0, "lam", running_delta=True, steer=(1e-3, 2.0, 0.2)), "exceeds lam's range"),
        ("toy", "takes a PolicySpec"),
    ]
    for s, match in bad:
        with pytest.raises(ValueError, match=match):
            register_policy(s)
    with pytest.raises(ValueError, match="built in"):
        unregister_policy("max-rank")

    class Coded(LRUCache):
        code = 7

    bad_rules = [
        (EVICTIONS["lru"], "already registered"),
        (EvictionRule("toy", dict), "ExpertCache subclass"),
        (EvictionRule("toy", Coded), "code 7 has no victim score"),
        (EvictionRule("toy", ToyLRU, admits=False), "admits=True"),
        (EvictionRule("toy", ToyLRU, offline=True), "offline=False"),
        (EvictionRule("toy", ToyLRU, params=("delta",)), "params"),
        (EvictionRule("a,b", ToyLRU), "eviction name"),
    ]
    for r, match in bad_rules:
        with pytest.raises(ValueError, match=match):
            register_eviction(r)
    with pytest.raises(ValueError, match="built in"):
        unregister_eviction("lru")
    assert tuple(POLICIES) == before and tuple(EVICTION_POLICIES) == evs


def test_every_built_in_declaration_passes_the_registration_checks():
    """The built-ins declare what their kernel code reads (the same checks a new policy meets)."""
    from dataclasses import replace

    from expertcache.cache.caches import BUILTIN

    for s in SPECS.values():
        if s.code is not None:
            with registered_policy(replace(s, name="copy-of-" + s.name)):
                pass
    for name in BUILTIN:
        with registered_eviction(replace(EVICTIONS[name], name="copy-of-" + name)):
            pass


def test_a_policy_whose_code_has_no_key_rule_fails_at_first_use(monkeypatch):
    """Written into SPECS past register_policy, an unknown code still never ranks as another rule: the kernel's
    dispatch raises before any token is ranked (it used to fall through to ERAS thresholding)."""
    from expertcache.routing import Router

    monkeypatch.setitem(SPECS, "ghost", PolicySpec("ghost", 9, "lam"))
    rc = RoutingConfig("ghost", lam=0.5)
    router = Router(rc, num_experts=8, k=2, renormalize=True)
    with pytest.raises(ValueError, match="kernel code 9 has no key rule"):
        router.rank(0, torch.randn(3, 8), None)
    with pytest.raises(ValueError, match="kernel code 9 has no key rule"):
        simulate(make_trace(t=5, l=1), rc, 4)


def test_unregistered_names_are_refused_everywhere():
    with pytest.raises(ValueError, match="unknown routing policy 'toy-max-rank'"):
        RoutingConfig("toy-max-rank")
    with pytest.raises(ValueError, match="unknown eviction policy 'toy-lru'"):
        make_cache("toy-lru", 8, 4)
    code, _, err = _cli(["simulate", "--policy", "toy-max-rank"])
    assert code == 2 and "invalid choice: 'toy-max-rank'" in err


# -- the toy policy and rule through every entry point --------------------------------------------------------------

def test_simulate_runs_the_toys_as_the_rules_they_copy(toys):
    tr = make_trace(t=120, l=3, e=8, k=2, seed=1, starts=[0, 70])
    for toy, orig in [(RoutingConfig("toy-max-rank", m=5), RoutingConfig("max-rank", m=5)),
                      (RoutingConfig("toy-cache-prior", lam=0.4), RoutingConfig("cache-prior", lam=0.4)),
                      (RoutingConfig("toy-eras-bias", beta=1.5), RoutingConfig("eras-bias", beta=1.5))]:
        freq = np.full((3, 8), 0.25, np.float32)
        freq[:, :3] = 0.9
        kw = dict(freq_LE=freq) if toy.policy == "toy-eras-bias" else {}
        got = simulate(tr, toy, 3, eviction="toy-lru", belady=True, **kw)
        want = simulate(tr, orig, 3, eviction="lru", belady=True, **kw)
        assert np.array_equal(got.ids_TLK, want.ids_TLK), toy.policy
        assert not np.array_equal(want.ids_TLK, tr.ids_TLK)  # the policy did re-route
        assert _as_copied(got.to_row()) == _as_copied(want.to_row())


def test_sweep_plans_and_runs_the_toys(toys, trace_file, tmp_path):
    """The sweep's grid follows the toy's strength field (M in K..N), its rows equal max-rank's and lru's, and
    ``--policies`` / ``--eviction`` accept the new names."""
    from expertcache.eval.sweep import open_loop_row, plan, policy_grid
    from expertcache.trace import RoutingTrace

    grid = policy_grid("toy-max-rank", k=2, num_experts=8)
    assert [rc.m for rc in grid] == list(range(2, 9)) and {rc.policy for rc in grid} == {"toy-max-rank"}
    tr = RoutingTrace.load(trace_file)
    runs = plan(mode="open-loop", source={}, policies=["toy-max-rank", "max-rank"], k=2, num_experts=8,
                capacities=[3], evictions=["toy-lru", "lru"])
    rows = {}
    for r in runs:
        rows[(r["routing"]["policy"], r["eviction"], r["routing"]["m"])] = open_loop_row(tr, r)
    assert len(rows) == 2 * 2 * 7
    for (pol, ev, m), row in rows.items():
        assert _as_copied(row) == _as_copied(rows[(COPIES.get(pol, pol), COPIES.get(ev, ev), m)])
    out = tmp_path / "rows.jsonl"
    code, _, err = _cli(["sweep", "--trace", trace_file, "--policies", "toy-max-rank", "--eviction", "toy-lru",
                         "--capacity", "3", "--out", str(out), "--no-progress"])
    assert code == 0, err
    cli_rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["miss_rate"] for r in cli_rows] == [rows[("max-rank", "lru", m)]["miss_rate"] for m in range(2, 9)]


def test_the_cli_accepts_and_lists_the_new_names(toys, trace_file):
    """``--policy`` / ``--eviction`` of simulate (and its help), the controller's target for a steerable toy,
    sweep's ``--policies`` help, generate's and bench's choices."""
    def run(*argv):
        code, out, err = _cli(["simulate", trace_file, "--capacity", "3", "--json", *argv])
        assert code == 0, err
        return json.loads(out)

    for toy, orig in [(["--policy", "toy-max-rank", "--m", "4", "--eviction", "toy-lru"], ["--policy", "max-rank",
                                                                                           "--m", "4"]),
                      (["--policy", "toy-cache-prior", "--target-miss-rate", "0.3"],
                       ["--policy", "cache-prior", "--target-miss-rate", "0.3"]),
                      (["--policy", "toy-eras-bias", "--beta", "2"], ["--policy", "eras-bias", "--beta", "2"])]:
        got, want = run(*toy), run(*orig)
        assert _as_copied(got) == _as_copied(want), toy
        assert ("controller" in got) == ("--target-miss-rate" in toy)
    helps = {}
    for cmd in ("simulate", "sweep", "generate", "bench", "eval"):
        code, out, _ = _cli([cmd, "--help"])
        assert code == 0
        helps[cmd] = " ".join(out.split())
    assert "toy-max-rank" in helps["simulate"] and "toy-lru" in helps["simulate"]
    assert "toy-cache-prior (lam)" in helps["simulate"] and "toy-cache-prior (lam)" in helps["eval"]
    assert "toy-max-rank" in helps["sweep"] and "toy-lru" in helps["sweep"]
    assert "toy-lru" in helps["generate"] and "toy-max-rank" in helps["bench"]
    args = build_parser("bench").parse_args(["bench", "--policies", "toy-max-rank"])
    assert args.policies == ["toy-max-rank"]
    args = build_parser("generate").parse_args(["generate", "--policy", "toy-max-rank", "--eviction", "toy-lru", "x"])
    assert (args.routing_policy, args.eviction) == ("toy-max-rank", "toy-lru")
    code, _, err = _cli(["simulate", trace_file, "--policy", "toy-max-rank", "--target-miss-rate", "0.3"])
    assert code == 2 and "not --policy toy-max-rank" in err  # not steerable: refused in one line


def test_bench_and_report_colours_read_the_registry(toys):
    from expertcache.eval.report import POLICY_COLORS
    from expertcache.offload.bench import DEFAULT_BENCH, bench_policies, policy_set

    pset = policy_set(4)
    rc, ev = pset["toy-max-rank"]
    assert (rc, ev) == (RoutingConfig("toy-max-rank", m=8), "lru") and pset["max-rank"][0].m == 8
    assert "toy-max-rank" in bench_policies() and "toy-max-rank" not in DEFAULT_BENCH
    colour = policy_colour("toy-max-rank")
    assert isinstance(colour, str) and colour == POLICY_COLORS["toy-max-rank"] == policy_colour("toy-max-rank")
    assert colour not in {s.colour for s in SPECS.values() if s.name not in COPIES}  # not a built-in's colour
    assert POLICY_COLORS["max-rank"] == "tab:orange"


@pytest.fixture(scope="module")
def tiny_eval(tmp_path_factory):
    from expertcache.eval import prepare
    from expertcache.eval.synthetic import save_tiny_with_tokenizer, write_toy_data

    root = tmp_path_factory.mktemp("reg-eval")
    model_dir = save_tiny_with_tokenizer("olmoe", root / "model")
    data_dir = write_toy_data(root / "data", wikitext_rows=12)
    return str(model_dir), str(data_dir), prepare(str(model_dir), "wikitext", data_dir=str(data_dir), limit=1)


def test_closed_loop_eval_of_the_toys(toys, tiny_eval):
    """``expertcache.eval.evaluate`` (perplexity, live caches in the patched model) and ``expertcache eval``."""
    from expertcache.eval import evaluate

    model_dir, data_dir, (model, _, task) = tiny_eval
    got = evaluate(model, task, RoutingConfig("toy-max-rank", m=6), eviction="toy-lru", capacity=3)
    want = evaluate(model, task, RoutingConfig("max-rank", m=6), eviction="lru", capacity=3)
    orig = evaluate(model, task, RoutingConfig(), eviction="lru", capacity=3)
    assert got["miss_rate"] < orig["miss_rate"]  # the policy acted
    assert _as_copied(got) == _as_copied(want)
    code, out, err = _cli(["eval", "--model", model_dir, "--task", "wikitext", "--data-dir", data_dir, "--limit", "1",
                           "--policy", "toy-max-rank", "--m", "6", "--eviction", "toy-lru", "--capacity", "3",
                           "--json", "--no-progress"])
    assert code == 0, err
    row = json.loads(out)
    assert (row["miss_rate"], row["quality"]) == (want["miss_rate"], want["quality"])


def test_the_offloaded_runtime_runs_the_toys(toys, tmp_path):
    from conftest import decode_logits
    from expertcache.models.tiny import save_tiny
    from expertcache.offload import OffloadConfig, OffloadedModel

    path = save_tiny("olmoe", tmp_path / "olmoe", seed=2)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))

    def run(routing, eviction):
        rt = OffloadedModel.from_pretrained(path, OffloadConfig(io="cached", capacity=2, readers=0),
                                            dtype=torch.float32, routing=routing, eviction=eviction, record=True)
        return decode_logits(rt, ids, prefill=4), np.asarray(rt.recorded_ids_TLK()), rt

    got, got_ids, rt = run(RoutingConfig("toy-max-rank", m=6), "toy-lru")
    want, want_ids, _ = run(RoutingConfig("max-rank", m=6), "lru")
    orig_ids = run(RoutingConfig(), "lru")[1]
    assert all(isinstance(st.cache, ToyLRU) for st in rt.states)
    assert np.array_equal(got_ids, want_ids) and not np.array_equal(want_ids, orig_ids)
    assert torch.equal(got, want)
    # the live view's controls over this runtime offer and accept them
    from types import SimpleNamespace

    from expertcache.serve.liveview import LiveControl

    control = LiveControl(SimpleNamespace(rt=rt), broker=None)
    choices = control.resolved()["choices"]
    assert "toy-max-rank" in choices["policy"] and choices["strength"]["toy-max-rank"] == "m"
    assert "toy-lru" in choices["eviction"] and "toy-lru" in choices["replay_eviction"]
    plan = control.validate({"policy": "toy-cache-prior", "lam": 0.3, "eviction": "toy-lru"})
    assert (plan["routing"], plan["eviction"]) == (RoutingConfig("toy-cache-prior", lam=0.3, top_j=1), "toy-lru")


def test_the_lm_eval_adapter_takes_the_toys(toys, tiny_eval):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from expertcache.integrations.lm_eval import ExpertCacheLM

    model_dir = tiny_eval[0]
    req = [Instance(request_type="loglikelihood", doc={}, arguments=("a b c", " d e"), idx=0)]
    answers = {}
    for policy, eviction in [("toy-max-rank", "toy-lru"), ("max-rank", "lru")]:
        lm = ExpertCacheLM(pretrained=model_dir, policy=policy, m="6", eviction=eviction, capacity="3")
        assert lm.routing == RoutingConfig(policy, m=6)
        answers[policy] = (lm.loglikelihood(req, disable_tqdm=True), lm.miss_report()["miss_rate"])
    assert answers["toy-max-rank"] == answers["max-rank"]


def test_the_live_view_lists_and_replays_the_toys(toys, trace_file):
    from expertcache.serve.control import routing_from as _routing_from
    from expertcache.serve.liveview import replay_frames
    from expertcache.trace import RoutingTrace

    assert _routing_from({"policy": "toy-max-rank", "m": 4}, {}) == RoutingConfig("toy-max-rank", m=4)
    tr = RoutingTrace.load(trace_file)
    got = replay_frames(tr, RoutingConfig("toy-max-rank", m=4), 3, eviction="toy-lru")
    want = replay_frames(tr, RoutingConfig("max-rank", m=4), 3, eviction="lru")
    assert _as_copied(got) == _as_copied(want)
