"""Issue 36: the mutants that survived the suite on 6bbe01b, each killed here by a check against an independent
computation, the paper or a boundary written out by hand (exactly at a limit, one past it).

Each test's docstring names the mutant it was seen to fail on: the one-line change applied by hand to the
source, this file run, the failure seen, the change reverted. Checks here call the public entry points (the
validators, ``plan``, ``host_allowed``, ``Guard``, ``resolve_device``, the registries); the serving engine's hold
and the row padding of every family have their own files (``test_engine_hold.py``, ``test_row_padding.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
import torch

# ---------------------------------------------------------------------------------------------------------
# device.py: cuda:N and auto under a faked device count (CI has no GPU; these branches run here anyway)


@pytest.fixture
def cuda_count(monkeypatch):
    """``set(n)``: torch reports a CUDA build with ``n`` visible devices (0: a CUDA build without a device)."""
    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.version, "cuda", "12.4")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_count


@pytest.mark.parametrize("n", [1, 2, 3])
def test_cuda_index_is_refused_exactly_from_the_device_count(cuda_count, n):
    """``cuda:0`` .. ``cuda:{n-1}`` resolve, ``cuda:{n}`` is refused naming the visible range. Fails on
    device.py's ``dev.index >= n`` → ``dev.index > n`` (``cuda:N`` with N the count accepted)."""
    from expertcache.device import resolve_device

    cuda_count(n)
    for i in range(n):
        assert resolve_device(f"cuda:{i}") == torch.device("cuda", i)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    for bad in (n, n + 1):
        with pytest.raises(ValueError, match=rf"--device cuda:{bad}: only {n} CUDA device\(s\) visible "
                                             rf"\(cuda:0..cuda:{n - 1}\)"):
            resolve_device(f"cuda:{bad}")


def test_auto_picks_the_first_cuda_device_when_one_is_visible(cuda_count):
    """``auto`` (and None) is ``cuda:0`` with a visible device, ``cpu`` without. Fails on device.py's auto
    branch → always ``cpu``."""
    from expertcache.device import resolve_device

    cuda_count(2)
    assert resolve_device("auto") == resolve_device(None) == torch.device("cuda", 0)
    cuda_count(0)
    assert resolve_device("auto") == resolve_device(None) == torch.device("cpu")
    with pytest.raises(ValueError, match="--device cuda: torch sees no CUDA device"):
        resolve_device("cuda")


# ---------------------------------------------------------------------------------------------------------
# models/loader.py: config and tokenizer validators at their limits


def test_tokenizer_exactly_the_embedding_is_accepted_one_more_is_refused(recwarn):
    """A tokenizer of ``vocab`` tokens (ids 0..vocab-1) fits a ``vocab``-row embedding; ``vocab + 1`` tokens (id
    ``vocab`` would index past the last row) are refused, naming both counts. Fails on loader.py's ``n > vocab``
    → ``n > vocab + 1`` (the old test added 16 tokens, so an off-by-one passed it)."""
    from expertcache.models.loader import check_tokenizer_fits

    vocab = 8192
    check_tokenizer_fits(range(vocab), vocab, "tok.json")  # len() is all the check reads
    assert not recwarn.list
    with pytest.raises(ValueError, match=r"tok.json: the tokenizer has 8193 tokens \(ids up to 8192\), the "
                                         r"model's embedding only 8192 rows"):
        check_tokenizer_fits(range(vocab + 1), vocab, "tok.json")


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "num_experts", "num_experts_per_tok"])
def test_a_bool_is_not_a_size(key):
    """JSON ``true`` is a Python int (== 1), but not a size: refused with the project's own message (transformers'
    messages also name the key, so the match is on ours). Fails on loader.py dropping ``isinstance(v, bool)``."""
    from expertcache.models.loader import check_config_values

    with pytest.raises(ValueError, match=rf"^cfg/config.json: {key} must be an integer >= 1, got true$"):
        check_config_values({key: True}, "cfg/config.json")
    check_config_values({key: 1}, "cfg/config.json")  # the same value as an integer: fine


@pytest.mark.parametrize("e_key, k_key", [("num_experts", "num_experts_per_tok"),
                                          ("num_local_experts", "experts_per_token"),
                                          ("n_routed_experts", "num_experts_per_tok")])
def test_top_k_may_equal_the_expert_count_not_exceed_it(e_key, k_key):
    """Top-k of E experts is valid for k = 1..E (k = E: every expert, dense routing); k = E + 1 is refused.
    Fails on loader.py's ``>`` → ``>=`` (no test config had k = E)."""
    from expertcache.models.loader import check_config_values

    for k in (1, 8):
        check_config_values({e_key: 8, k_key: k}, "c.json")
    with pytest.raises(ValueError, match=rf"c.json: {k_key}=9 must be in \[1, {e_key}=8\]"):
        check_config_values({e_key: 8, k_key: 9}, "c.json")


def test_the_size_check_counts_the_experts(tmp_path):
    """Beside a 1,000-parameter checkpoint, a config of one layer, H = F = 8 implies 4·H² + E·3·H·F = 256 + 192·E
    parameters (the loader's documented estimate); the margin is 16 × 1,000 + 10⁶ = 1,016,000, so 5,290 experts
    pass and 5,291 are refused -- only the expert count differs. Fails on loader.py's size estimate ignoring the
    expert count (only a huge layer count was tested)."""
    from safetensors.torch import save_file

    from expertcache.models.loader import check_config_values

    save_file({"w": torch.zeros(1000)}, str(tmp_path / "model.safetensors"))
    cfg = dict(hidden_size=8, num_hidden_layers=1, moe_intermediate_size=8)
    assert 256 + 192 * 5290 <= 1_016_000 < 256 + 192 * 5291
    check_config_values(dict(cfg, num_experts=5290), tmp_path / "config.json")
    with pytest.raises(ValueError, match="5291 experts of 8.*implies ~1.02e\\+06 parameters.*hold 1e\\+03"):
        check_config_values(dict(cfg, num_experts=5291), tmp_path / "config.json")


# ---------------------------------------------------------------------------------------------------------
# serve/app.py: the Host allow-list and the request-size limit


def test_only_localhost_and_its_subdomains_pass_as_localhost():
    """RFC 6761: ``localhost`` and names *under* it (``a.localhost``) are loopback; a name merely ending in the
    letters ``localhost`` is someone else's domain. Fails on app.py's ``endswith(".localhost")`` →
    ``endswith("localhost")``."""
    from expertcache.serve.app import LOOPBACK_HOSTS, host_allowed

    for ok in ("localhost", "localhost:8000", "a.localhost", "a.b.localhost:1", "A.LOCALHOST"):
        assert host_allowed(ok, LOOPBACK_HOSTS), ok
    for bad in ("evil-localhost", "notlocalhost", "notlocalhost:8000", "xlocalhost", "localhost-evil.example"):
        assert not host_allowed(bad, LOOPBACK_HOSTS), bad
    assert not host_allowed("a.localhost", ("127.0.0.1",))  # only when localhost itself is allowed


def _guard_call(guard, length: int) -> int:
    """Status of one POST through ``guard`` with ``Content-Length: length`` (200: passed to the app)."""
    sent = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = dict(type="http", path="/v1/completions", method="POST", scheme="http", query_string=b"",
                 headers=[(b"host", b"localhost:8000"), (b"content-type", b"application/json"),
                          (b"content-length", str(length).encode())])
    asyncio.run(guard(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_a_body_of_exactly_the_limit_passes_the_guard_one_byte_more_is_413():
    """``--max-request-bytes N`` takes bodies of N bytes: Content-Length N reaches the app, N + 1 is a 413 before
    any byte is read. Fails on app.py's ``int(length) > max`` → ``>=``."""
    from fastapi.responses import PlainTextResponse

    from expertcache.serve.app import Guard

    async def app(scope, receive, send):
        await PlainTextResponse("ok")(scope, receive, send)

    guard = Guard(app, max_request_bytes=1000, allowed_hosts=("localhost",))
    assert [_guard_call(guard, n) for n in (0, 999, 1000, 1001, 10**9)] == [200, 200, 200, 413, 413]


class _Chunked:
    """A request whose body arrives in ``chunks`` (no Content-Length)."""

    def __init__(self, chunks):
        self.chunks = chunks

    async def stream(self):
        for c in self.chunks:
            yield c


@pytest.mark.parametrize("split", [1, 3, 10])
def test_a_chunked_body_of_exactly_the_limit_is_read_one_byte_more_is_413(split):
    """The same limit on a body with no Content-Length (read chunk by chunk): N bytes are returned whole,
    N + 1 are refused. Fails on read_body's ``n > limit`` → ``>=``."""
    from expertcache.serve.app import ServeError, read_body

    def chunks(n):
        body = bytes(range(97, 97 + 26)) * (n // 26 + 1)
        body = body[:n]
        step = -(-n // split)
        return body, [body[i:i + step] for i in range(0, n, step)]

    body, parts = chunks(1000)
    assert asyncio.run(read_body(_Chunked(parts), 1000)) == body
    _, parts = chunks(1001)
    with pytest.raises(ServeError) as exc:
        asyncio.run(read_body(_Chunked(parts), 1000))
    assert exc.value.status == 413 and "1000 bytes" in str(exc.value)


# ---------------------------------------------------------------------------------------------------------
# registries.py: scoped registration and removal


def _toy_policy():
    from expertcache.routing import PolicySpec

    return PolicySpec("survivor-cache-prior", 0, "lam", running_delta=True)  # Cache-Prior's key rule, new name


def _toy_rule():
    from expertcache.cache.caches import EvictionRule
    from expertcache.cache.lru import LRUCache

    return EvictionRule("survivor-lru", LRUCache)


def test_a_scoped_registration_is_removed_when_its_block_raises():
    """``with registered_policy(...)`` / ``registered_eviction(...)``: the name exists inside the block and is gone
    after it, also when the block raises (a failing test must not leave its policy to the next). Fails on
    registries.py's ``registered`` without its ``try/finally``."""
    from expertcache.cache.caches import EVICTIONS, registered_eviction
    from expertcache.routing.registry import POLICIES, registered_policy

    for scoped, names, item in ((registered_policy, POLICIES, _toy_policy()),
                                (registered_eviction, EVICTIONS, _toy_rule())):
        with pytest.raises(RuntimeError, match="inside"):
            with scoped(item):
                assert item.name in names
                raise RuntimeError("inside the block")
        assert item.name not in names
        with scoped(item):  # registrable again: nothing was left behind
            assert item.name in names
        assert item.name not in names


def test_unregistering_an_unknown_name_names_the_known_ones():
    """``unregister_policy("nope")`` is a ValueError listing the registered names (the lookup's own message),
    not a bare ``KeyError: 'nope'``; a built-in name is refused as built in. Fails on registries.py's
    ``unregister`` without its ``lookup(name)``."""
    from expertcache.cache.caches import unregister_eviction
    from expertcache.routing.registry import unregister_policy

    with pytest.raises(ValueError, match=r"unknown routing policy 'nope'; choose one of original, prune"):
        unregister_policy("nope")
    with pytest.raises(ValueError, match=r"unknown eviction policy 'nope'; choose one of lru, lfu"):
        unregister_eviction("nope")
    with pytest.raises(ValueError, match="routing policy 'original' is built in"):
        unregister_policy("original")
    with pytest.raises(ValueError, match="eviction rule 'belady' is built in"):
        unregister_eviction("belady")


# ---------------------------------------------------------------------------------------------------------
# eval/sweep.py: which policy × eviction pairs a plan holds


#: 001 Sec. 4.8: Belady's bound needs the whole request sequence in advance, i.e. selections that do not depend
#: on the cache: the two residency-independent policies (original top-K, pruning to the top h)
FIXED_SELECTIONS = {"original", "prune"}


def test_a_plan_holds_every_pair_but_belady_with_a_cache_aware_policy():
    """The plan over every registered policy and eviction rule holds, open loop, each (policy, eviction) pair
    except Belady with a cache-aware policy -- enumerated here from the names, not from the plan's rule -- each
    pair with its policy's whole grid; closed loop, no Belady at all. Fails on sweep.py's plan dropping
    pruning × Belady (``spec(pol).code is not None`` → ``spec(pol).strength is not None``)."""
    from expertcache.cache.caches import EVICTIONS
    from expertcache.eval.sweep import plan, policy_grid
    from expertcache.routing.registry import SPECS

    pols, evs = list(SPECS), list(EVICTIONS)
    assert FIXED_SELECTIONS <= set(pols) and "belady" in evs
    k, n = 2, 8
    for mode in ("open-loop", "closed-loop"):
        runs = plan(mode=mode, source={"trace": "t"}, policies=pols, k=k, num_experts=n, capacities=[4],
                    evictions=evs, points=3)
        got = {}
        for r in runs:
            key = (r["routing"]["policy"], r["eviction"])
            got.setdefault(key, []).append(r["routing"])
        want = {(p, e) for p, e in itertools.product(pols, evs)
                if e != "belady" or (mode == "open-loop" and p in FIXED_SELECTIONS)}
        assert set(got) == want, (mode, sorted(want ^ set(got)))
        for (p, _), routings in got.items():
            assert routings == [rc.to_dict() for rc in policy_grid(p, k=k, num_experts=n, points=3)], p
    # prune × Belady by hand: h = 1..K, one run each
    prune = [r for r in plan(mode="open-loop", source={}, policies=["prune"], k=3, num_experts=8, capacities=[2],
                             evictions=["belady"])]
    assert [r["routing"]["h"] for r in prune] == [1, 2, 3] and {r["eviction"] for r in prune} == {"belady"}
    assert json.loads(json.dumps(prune)) == prune  # JSON-able, as the plan promises


# ---------------------------------------------------------------------------------------------------------
# offload/step.py: the order a step is served in, written once (union_order) for the runtime and the live view


def test_one_token_is_served_in_its_routers_descending_weight_order(tmp_path):
    """One token's experts are requested in descending router weight (the order its top-K gives them; an LRU then
    keeps the heaviest most recent), computed here as top-K of softmax(logits) from each routing event, in the
    runtime's step events (one-token decode steps) and from ``union_order`` itself, which the live view's shadow
    cache calls. Fails on ``union_order``'s one-token branch reversed (the runtime had its own copy of that branch,
    so reversing the live view's went unseen)."""
    from expertcache.models.tiny import save_tiny
    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.offload.step import union_order
    from conftest import decode_logits

    rt = OffloadedModel.from_pretrained(save_tiny("olmoe", tmp_path / "olmoe", seed=4),
                                        OffloadConfig(io="cached", capacity=3), dtype=torch.float32)
    routes, steps = [], []
    rt.add_router_observer(routes.append)
    rt.add_step_observer(lambda ev: steps.append(ev) if ev.kind == "demand" else None)
    decode_logits(rt, torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2)), prefill=1)
    assert len(routes) == len(steps) == 9 * len(rt.layers)
    for r, s in zip(routes, steps):
        w_K, ids_K = torch.topk(torch.softmax(r.logits[0].float(), dim=-1), rt.top_k)
        assert r.layer == s.layer and list(s.order) == ids_K.tolist()
        assert union_order(ids_K[None], w_K[None], rt.num_experts) == ids_K.tolist()
    assert union_order(torch.tensor([[6, -1, 2]]), None, 8) == [6, 2]  # dropped slots skipped, order kept


@pytest.mark.parametrize("name, ok", [("a", True), ("0", True), ("my-rule.v2_x", True), ("", False), ("A", False),
                                      ("a,b", False), ("a+b", False), ("-a", False), (".a", False), ("a b", False),
                                      (5, False), (None, False)])
def test_one_name_rule_for_policies_and_evictions(name, ok):
    """Both registries take the same names (registries.NAME): no comma (sweep's comma-separated --policies and
    --eviction), no '+' (bench's original+lru), no upper case, not starting with a separator."""
    from dataclasses import replace

    from expertcache.cache.caches import registered_eviction
    from expertcache.routing.registry import registered_policy

    for scoped, item, what in ((registered_policy, _toy_policy(), "policy"), (registered_eviction, _toy_rule(), "eviction")):
        item = replace(item, name=name)
        if ok:
            with scoped(item):
                pass
        else:
            with pytest.raises(ValueError, match=f"^{what} name must be lower-case letters"):
                with scoped(item):
                    pass


# ---------------------------------------------------------------------------------------------------------
# routing: the strength fields and their ranges, declared once (routing/registry.py: STRENGTH_RANGES)


@pytest.mark.parametrize("policy, name, low, high", [("cumsum", "p", 0.0, 1.0), ("cache-prior", "lam", 0.0, 1.0),
                                                     ("eras-threshold", "alpha", 0.0, None),
                                                     ("eras-bias", "beta", 0.0, None)])
def test_strength_ranges_at_their_limits(policy, name, low, high):
    """001/003's strengths: p (Alg. 2's cumulative threshold) and λ (Eq. 9's mixing weight) are fractions, α and β
    non-negative: each accepted exactly at its limits, refused one ulp past them, naming the field."""
    import math

    from expertcache.routing import RoutingConfig
    from expertcache.routing.registry import SPECS, STRENGTH_RANGES

    assert STRENGTH_RANGES[name] == (low, high)
    assert {s.strength for s in SPECS.values()} - {None, "h", "m"} == set(STRENGTH_RANGES)
    RoutingConfig(policy, **{name: low})
    RoutingConfig(policy, **{name: high if high is not None else 1e6})
    past = [math.nextafter(low, -1.0)] + ([math.nextafter(high, 2.0)] if high is not None else [])
    for v in past:
        with pytest.raises(ValueError, match=rf"^{name} must be"):
            RoutingConfig(policy, **{name: v})


def test_the_servers_shared_defaults_are_one_light_declaration():
    """The request-size default and the loopback names are declared once (serve/defaults.py) and read by the app
    and the command line; that module imports nothing heavy (the command line reads it to build --help)."""
    import subprocess
    import sys

    from expertcache.cli import serve as cli_serve
    from expertcache.serve import app, defaults

    assert cli_serve.DEFAULT_MAX_REQUEST_BYTES is app.DEFAULT_MAX_REQUEST_BYTES is defaults.DEFAULT_MAX_REQUEST_BYTES
    assert cli_serve.LOOPBACK_HOSTS is app.LOOPBACK_HOSTS is defaults.LOOPBACK_HOSTS
    code = ("import sys, expertcache.serve.defaults\n"
            "print(sorted(m for m in ('torch', 'numpy', 'transformers', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    for host in ("localhost", "127.0.0.1", "::1", "[::1]", "127.8.9.10", "ip6-localhost"):
        assert defaults.is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.168.1.2", "localhost.example", "evil-localhost"):
        assert not defaults.is_loopback(host), host


# ---------------------------------------------------------------------------------------------------------
# more validator boundaries (the same files: a fresh mutant there should fail a test too)


def test_config_counts_and_reals_at_their_limits():
    """Sizes are integers ≥ 1 (counts of shared experts and dense layers ≥ 0); rms_norm_eps, rope_theta and
    routed_scaling_factor are positive and finite: each accepted at its limit, refused just past it."""
    import math

    from expertcache.models.loader import check_config_values

    check_config_values({"hidden_size": 1, "n_shared_experts": 0, "first_k_dense_replace": 0}, "c.json")
    for bad, culprit in (({"hidden_size": 0}, "hidden_size must be an integer >= 1, got 0"),
                         ({"n_shared_experts": -1}, "n_shared_experts must be an integer >= 0, got -1"),
                         ({"hidden_size": 2.0}, "hidden_size must be an integer >= 1, got 2.0")):
        with pytest.raises(ValueError, match=culprit):
            check_config_values(bad, "c.json")
    for key in ("rms_norm_eps", "rope_theta", "routed_scaling_factor"):
        check_config_values({key: 5e-324}, "c.json")  # the smallest positive double
        check_config_values({key: 1.7e308}, "c.json")
        for v in (0, 0.0, -1e-9, math.inf, math.nan, True):
            with pytest.raises(ValueError, match=f"{key} must be a positive finite number"):
                check_config_values({key: v}, "c.json")


def test_tokenizer_warns_below_ninety_percent_of_the_vocabulary_only():
    """Covering 90 % of the embedding rows is normal padding (no warning); one token fewer warns, naming the
    undecodable id range."""
    import warnings

    from expertcache.inputs import InputWarning
    from expertcache.models.loader import check_tokenizer_fits

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_tokenizer_fits(range(900), 1000, "t.json")
    with pytest.warns(InputWarning, match=r"t.json: the tokenizer has 899 tokens.*ids 899..999"):
        check_tokenizer_fits(range(899), 1000, "t.json")


@pytest.mark.parametrize("text, want", [("auto", "auto"), (" CPU ", "cpu"), ("cuda", "cuda"), ("CUDA:01", "cuda:1"),
                                        ("cuda:0", "cuda:0"), ("cuda:", None), ("cuda:-1", None), ("cuda:1.0", None),
                                        ("gpu", None), ("", None), ("cuda0", None)])
def test_device_names(text, want):
    """``--device`` spellings: the canonical name, or one line naming the flag and the choices."""
    from expertcache.device import DEVICE_CHOICES, parse_device

    if want is None:
        with pytest.raises(ValueError, match=f"--device {text}: not a device; choose {DEVICE_CHOICES}"):
            parse_device(text)
    else:
        assert parse_device(text) == want


def test_the_guard_refuses_a_length_that_is_not_a_number_and_a_missing_host():
    """Content-Length must be digits (``-1``, ``1e3``, ``0x10``, empty: 413s, not a pass); a request without a Host
    header (HTTP/1.0) is refused when the server has an allow-list."""
    from fastapi.responses import PlainTextResponse

    from expertcache.serve.app import Guard, host_allowed

    async def app(scope, receive, send):
        await PlainTextResponse("ok")(scope, receive, send)

    guard = Guard(app, max_request_bytes=1000, allowed_hosts=("localhost",))
    for length in ("-1", "1e3", "0x10", ""):
        assert _guard_call(guard, length) == 413, length
    assert not host_allowed("", ("localhost",)) and not host_allowed(None, ("localhost",))
    assert host_allowed(None, None) and host_allowed("anything", ("*",))
