"""The live view of `expertcache serve` (issue 16): the page, its event stream, live controls and trace replay.

Endpoint tests (httpx against a real server on 127.0.0.1, ephemeral port, the shipped granular model on CPU):
frames follow the documented schema and add up to the request's own cache statistics, a subscriber that
never reads leaves generation unchanged and its queue bounded, bad configurations get a 400 naming the field,
a change is applied between two forwards, replay frames add up to the simulator's counts.

Browser tests (``-m browser`` selects them; they run by default and skip without chromium + chromedriver, or
fail under CI=true): headless Chromium driven by Selenium loads the page with no console errors, streams a
prompt, the grid changes during generation (a screenshot is saved: to $EXPERTCACHE_LIVEVIEW_SCREENSHOT if set,
else under pytest's tmp path), the λ control changes the configuration the server reports, a trace replays.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from expertcache.offload import OffloadConfig, OffloadedModel  # noqa: E402
from expertcache.offload.runtime import resolve_model_path  # noqa: E402
from expertcache.routing import RoutingConfig  # noqa: E402
from expertcache.serve.app import create_app  # noqa: E402
from expertcache.serve.engine import Engine  # noqa: E402
from expertcache.serve.liveview import STATIC, Broker, list_traces, parse_replay, shipped_traces  # noqa: E402
from expertcache.serve.server import ServerThread  # noqa: E402
from expertcache.sim import replay as sim_replay, simulate  # noqa: E402
from expertcache.trace.format import RoutingTrace  # noqa: E402
from expertcache.train.tokenizer import load_tokenizer  # noqa: E402

C = 8
TRACE = "granular-wikitext2.trace.safetensors"
LAYER_KEYS = {"requested", "hit", "miss", "low", "evicted", "prefetched", "resident"}
STEP_KEYS = {"type", "seq", "time", "phase", "rows", "tokens", "seconds", "hits", "misses", "bytes_read", "layers",
             "totals", "dropped", "original"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def server():
    tok = load_tokenizer(resolve_model_path("granular"))
    rt = OffloadedModel.from_pretrained("granular", OffloadConfig(io="cached", capacity=C))
    engine = Engine(rt, tok, max_batch=4, max_queue=16).start()
    srv = ServerThread(create_app(engine, "granular", tokenizer=tok)).start()
    yield srv
    srv.stop()
    engine.shutdown(0)


def _lv(server):
    return server.app.state.liveview


def _reset(server):
    r = httpx.post(server.url + "/v1/expertcache/config",
                   json={"policy": "original", "eviction": "lru", "capacity": C, "top_j": 1})
    assert r.status_code == 200, r.text


def _wait(cond, timeout=30.0, what="condition"):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _complete(server, prompt="The history of the city", n=16, **kw):
    body = dict(model="granular", prompt=prompt, max_tokens=n, temperature=0, return_token_ids=True, **kw)
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    # the response leaves on the last token; that forward's frame follows before the row retires
    eng = server.app.state.engine
    _wait(lambda: eng.in_flight() == 0, what="the request to retire")
    return r.json()


class Listener:
    """Reads /v1/expertcache/events in a thread until ``stop``."""

    def __init__(self, server) -> None:
        self.server, self.frames, self.stop = server, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        _wait(lambda: self.frames, what="the subscription")  # hello is sent once subscribed

    def _run(self):
        with httpx.stream("GET", self.server.url + "/v1/expertcache/events", timeout=60) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.frames.append(json.loads(line[6:]))
                if self.stop.is_set():
                    return

    def close(self, n_steps: int):
        _wait(lambda: sum(f["type"] == "step" for f in self.frames) >= n_steps, what=f"{n_steps} frames")
        self.stop.set()
        return self.frames


def _check_layer(ly: dict, prev_resident: set, capacity: int, n: int) -> set:
    assert set(ly) == LAYER_KEYS
    req, hit, miss, ev, res = set(ly["requested"]), set(ly["hit"]), set(ly["miss"]), set(ly["evicted"]), \
        set(ly["resident"])
    assert hit | miss == req and not hit & miss
    assert hit <= prev_resident and not (miss & prev_resident)  # a hit was resident before the step, a miss not
    assert ev <= prev_resident and not (ev & res)
    assert res - prev_resident <= miss | set(ly["prefetched"])  # nothing appears without a load
    assert len(res) <= capacity and all(0 <= e < n for e in res | req)
    return res


# ---------------------------------------------------------------------------------------------------------
# endpoints


def test_page_and_static_files_are_shipped_and_served(server):
    names = {p.name for p in STATIC.iterdir()}
    assert {"index.html", "app.js", "style.css"} <= names
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert '"serve/static/*"' in pyproject.read_text()  # shipped in the wheel
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<script src="/static/app.js">' in r.text
    for name, ctype in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = httpx.get(server.url + "/static/" + name)
        assert r.status_code == 200 and r.headers["content-type"].startswith(ctype)
    for path in ("/static/nothing.js", "/static/..%2Fapp.py", "/static/liveview.py"):
        r = httpx.get(server.url + path)
        assert r.status_code == 404 and r.json()["error"]["message"], path
    # offline: the page and its script load nothing from another host
    for name in ("index.html", "app.js", "style.css"):
        text = (STATIC / name).read_text()
        assert "http://" not in text and "https://" not in text, name


def test_event_frames_follow_the_schema_and_add_up_to_the_requests_statistics(server):
    _reset(server)
    lis = Listener(server)
    hello = lis.frames[0]
    assert hello["type"] == "hello" and hello["schema_version"] == 1
    cfg = hello["config"]
    L, N = cfg["moe_layers"], cfg["num_experts"]
    assert (L, N, cfg["capacity"]) == (4, 32, C) and len(hello["layers"]) == L
    out = _complete(server, n=12)
    n_tok = out["usage"]["completion_tokens"]
    frames = [f for f in lis.close(n_tok) if f["type"] == "step"][:n_tok]  # 1 prefill + (n - 1) decode forwards
    assert [f["phase"] for f in frames] == ["prefill"] + ["decode"] * (n_tok - 1)
    resident = [set(ly["resident"]) for ly in hello["layers"]]
    for i, f in enumerate(frames):
        assert set(f) == STEP_KEYS and len(f["layers"]) == L
        assert f["seq"] == frames[0]["seq"] + i  # in order, none dropped by a reader that keeps up
        for li, ly in enumerate(f["layers"]):
            resident[li] = _check_layer(ly, resident[li], C, N)
        assert f["hits"] == sum(len(ly["hit"]) for ly in f["layers"])
        assert f["misses"] == sum(len(ly["miss"]) for ly in f["layers"])
        if f["phase"] == "decode":  # a one-token step requests exactly K experts per layer
            assert all(len(ly["requested"]) == cfg["top_k"] for ly in f["layers"])
    ec = out["expertcache"]
    assert sum(f["hits"] for f in frames) == round(ec["hits"])
    assert sum(f["misses"] for f in frames) == round(ec["misses"])
    assert sum(f["bytes_read"] for f in frames) == ec["bytes_read"]
    t = frames[-1]["totals"]
    assert t["hit_rate"] == pytest.approx(t["hits"] / (t["hits"] + t["misses"]))
    assert t["bytes_per_token"] == pytest.approx(t["decode_bytes"] / t["decode_tokens"]) and t["tok_s"] > 0


def test_frames_equal_an_independent_runtime_on_the_same_tokens(server):
    """From empty caches (original routing, LRU, C = 8), the frames of one request -- what the live view's hooks
    observed -- equal what a separate runtime records for the same prompt and tokens, with no live view: per
    layer, each decode step's requested ids (its recorded steps), the hits and misses summed over the frames
    (its cache statistics) and the residency after the last step."""
    httpx.post(server.url + "/v1/expertcache/config", json={"capacity": C - 1})
    _reset(server)  # a cache-size change restarts the caches empty
    rt = server.app.state.engine.rt
    assert all(not st.cache.resident() for st in rt.states)
    prompt = [17, 305, 44, 1020, 9, 77, 512]
    lis = Listener(server)
    out = _complete(server, prompt=prompt, n=10, ignore_eos=True)
    toks = out["expertcache"]["token_ids"]
    frames = [f for f in lis.close(len(toks)) if f["type"] == "step"][:len(toks)]
    assert [f["phase"] for f in frames] == ["prefill"] + ["decode"] * (len(toks) - 1)
    ref = OffloadedModel.from_pretrained("granular", OffloadConfig(io="cached", capacity=C), record=True)
    ref.generate(torch.tensor([prompt]), len(toks), forced_BN=torch.tensor([toks]))
    rec = ref.recorded_ids_TLK()
    assert rec.shape[0] == len(toks) - 1
    for li, st in enumerate(ref.states):
        assert [f["layers"][li]["requested"] for f in frames[1:]] == rec[:, li].tolist()
        cs = st.cache.stats
        assert sum(len(f["layers"][li]["hit"]) for f in frames) == cs.hits
        assert sum(len(f["layers"][li]["miss"]) for f in frames) == cs.misses
        assert frames[-1]["layers"][li]["resident"] == sorted(st.cache.resident())
    ref.close()


def test_original_routing_shadow_rate(server):
    """A cache-aware policy's frames carry original routing's hits on the same tokens (a shadow cache). At zero
    strength the policy routes exactly as the original, so the two counts agree exactly; under original
    routing there is nothing to compare."""
    _reset(server)
    lis = Listener(server)
    _complete(server, n=6)
    frames = [f for f in lis.close(6) if f["type"] == "step"]
    assert all(f["original"] is None for f in frames)
    for lam, same in ((0.0, True), (0.9, False)):
        httpx.post(server.url + "/v1/expertcache/config", json={"policy": "cache-prior", "lam": lam})
        lis = Listener(server)
        out = _complete(server, prompt="In 1990 the city of", n=16, ignore_eos=True)
        frames = [f for f in lis.close(16) if f["type"] == "step"]
        o = frames[-1]["original"]
        assert o["policy_hits"] == sum(f["hits"] for f in frames) == round(out["expertcache"]["hits"])
        assert o["policy_misses"] == sum(f["misses"] for f in frames)
        if same:
            assert (o["hits"], o["misses"]) == (o["policy_hits"], o["policy_misses"])
        assert o["hit_rate"] == pytest.approx(o["hits"] / (o["hits"] + o["misses"]))
    _reset(server)


def test_prefetches_show_as_prefetched_not_as_demand_misses(server):
    _reset(server)
    rt, eng = server.app.state.engine.rt, server.app.state.engine
    lis = Listener(server)
    absent = [e for e in range(rt.num_experts) if e not in rt.states[0].cache][:3]
    before = dict(_lv(server)["tap"].totals)
    with eng._lock:  # the engine is idle and cannot start a forward meanwhile
        assert eng.in_flight() == 0 and rt.prefetch(0, absent) == 3
    _complete(server, n=2)
    f = next(f for f in lis.close(1) if f["type"] == "step")
    ly = f["layers"][0]
    assert ly["prefetched"] == sorted(absent)
    t = f["totals"]  # the totals' transfers count the prefetch loads too
    assert t["prefetched"] - before["prefetched"] == 3 and t["transfers"] == t["misses"] + t["prefetched"]
    assert not set(absent) & set(ly["miss"])  # loaded ahead: a request for them is a hit, not a miss
    assert all(not x["prefetched"] for x in f["layers"][1:])
    _reset(server)


def test_a_subscriber_that_never_reads_does_not_block_or_change_generation(server):
    _reset(server)
    lv = _lv(server)
    alone = _complete(server, n=24, ignore_eos=True)["expertcache"]["token_ids"]
    # a stuck reader: its event loop never runs, so nothing is ever taken from its queue
    stuck_loop = asyncio.new_event_loop()
    stuck = lv["broker"].subscribe(stuck_loop)
    stuck.frames = type(stuck.frames)(maxlen=4)
    # and a real connection that never reads a byte
    n_before = len(lv["broker"].subscribers) - 1
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"GET /v1/expertcache/events HTTP/1.1\r\nHost: x\r\n\r\n")
    _wait(lambda: len(lv["broker"].subscribers) >= n_before + 2, what="the silent subscriber")
    try:
        published0 = lv["broker"].published
        _reset(server)
        with_readers = _complete(server, n=24, ignore_eos=True)["expertcache"]["token_ids"]
        assert with_readers == alone  # same tokens (frames dropped, never tokens)
        published = lv["broker"].published - published0
        assert published >= 24
        assert len(stuck.frames) == 4 and stuck.dropped == published - 4 and stuck.delivered == 0
        assert lv["tap"].totals["forwards"] >= 24
        for s in lv["broker"].subscribers:
            assert len(s.frames) <= s.frames.maxlen
    finally:
        lv["broker"].unsubscribe(stuck)
        stuck_loop.close()
        sock.close()
    _wait(lambda: len(lv["broker"].subscribers) <= n_before, what="the closed subscriber to leave")


def test_broker_queue_is_bounded_and_drops_the_oldest():
    b = Broker(maxlen=3)
    loop = asyncio.new_event_loop()
    try:
        s = b.subscribe(loop)
        for i in range(100):
            b.publish({"seq": i})
        assert [f["seq"] for f in s.take()] == [97, 98, 99] and s.dropped == 97
        b.publish({"seq": 100})
        assert [f["seq"] for f in s.take()] == [100] and s.delivered == 4
        b.unsubscribe(s)
        b.publish({"seq": 101})
        assert s.take() == []
    finally:
        loop.close()


BAD_CONFIGS = [
    ({"policy": "fastest"}, "policy"),
    ({"policy": "cache-prior", "lam": 1.5}, "lam"),
    ({"lam": "high"}, "lam"),
    ({"lam": True}, "lam"),
    ({"top_j": 9}, "top_j"),
    ({"top_j": 1.5}, "top_j"),
    ({"eviction": "belady"}, "eviction"),
    ({"eviction": "fifo"}, "eviction"),
    ({"eviction": ["lru"]}, "eviction"),
    ({"eviction": {"name": "lru"}}, "eviction"),
    ({"capacity": 0}, "capacity"),
    ({"capacity": 33}, "capacity"),
    ({"gamma": 0}, "gamma"),
    ({"h": 99, "policy": "prune"}, "h"),
    ({"policy": "eras-bias", "beta": 1.0}, "policy"),  # needs a frequency profile the server was not given
    ({"turbo": 1}, "turbo"),
    ([1, 2], "body"),
]


@pytest.mark.parametrize("body,param", BAD_CONFIGS, ids=[p for _, p in BAD_CONFIGS])
def test_bad_configurations_get_400_naming_the_field_and_change_nothing(server, body, param):
    before = httpx.get(server.url + "/v1/expertcache/config").json()
    r = httpx.post(server.url + "/v1/expertcache/config", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
    assert httpx.get(server.url + "/v1/expertcache/config").json() == before
    r = httpx.post(server.url + "/v1/expertcache/config", content=b"{not json",
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def test_config_changes_reach_the_runtime_and_are_applied_between_forwards(server):
    rt = server.app.state.engine.rt
    _reset(server)
    c = httpx.post(server.url + "/v1/expertcache/config", json={"policy": "cache-prior", "lam": 0.4}).json()
    assert c["routing"]["policy"] == "cache-prior" and c["routing"]["lam"] == 0.4 and not c["pending"]
    assert rt.routing == RoutingConfig(policy="cache-prior", lam=0.4, top_j=1) and c["label"] == rt.routing.label()
    assert httpx.get(server.url + "/v1/expertcache/config").json() == c
    out = _complete(server, n=4)
    assert out["expertcache"]["policy"] == "cache-prior(lam=0.4,J=1)"
    # eviction and C restart the caches (empty), a routing change keeps them
    c = httpx.post(server.url + "/v1/expertcache/config", json={"eviction": "lfu", "capacity": 4}).json()
    assert (c["eviction"], c["capacity"], rt.eviction, rt.capacity) == ("lfu", 4, "lfu", 4)
    assert all(len(st.cache) == 0 for st in rt.states)
    _complete(server, n=4)
    resident = [st.cache.resident() for st in rt.states]
    assert all(0 < len(r) <= 4 for r in resident)
    httpx.post(server.url + "/v1/expertcache/config", json={"lam": 0.9})
    assert [st.cache.resident() for st in rt.states] == resident and rt.routing.lam == 0.9
    # while a request decodes, a change waits for the engine thread's next forward boundary
    _reset(server)
    eng = server.app.state.engine
    done = {}
    th = threading.Thread(target=lambda: done.update(_complete(server, n=48, ignore_eos=True)))
    th.start()
    try:
        _wait(lambda: eng.batch_size() == 1 and len(eng._rows[0].tokens) >= 2, what="decoding")
        c = httpx.post(server.url + "/v1/expertcache/config", json={"policy": "cache-prior", "lam": 0.3}).json()
        # the response waits for the engine thread to apply it after its next forward
        assert c["pending"] is False and c["routing"]["lam"] == 0.3 and rt.routing.lam == 0.3
        assert eng.in_flight() == 1  # applied while the request was still decoding
    finally:
        th.join(120)
    assert done["usage"]["completion_tokens"] == 48
    _reset(server)


# ---------------------------------------------------------------------------------------------------------
# replay


@pytest.fixture(scope="module")
def trace():
    return RoutingTrace.load(shipped_traces()[TRACE])


@pytest.mark.parametrize("body", [
    dict(policy="original", eviction="lru", capacity=8, start=0, steps=96),
    dict(policy="cache-prior", lam=0.5, eviction="lfu", capacity=6, start=256, steps=64),
    dict(policy="original", eviction="belady", capacity=8, start=0, steps=64),
    dict(policy="max-rank", m=4, eviction="gamma", capacity=12, start=100, steps=40),
], ids=["original-lru", "cache-prior-lfu", "belady", "max-rank-gamma"])
def test_replay_frames_add_up_to_the_simulator(server, trace, body):
    r = httpx.post(server.url + "/v1/expertcache/replay", json=dict(body, trace=TRACE), timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    frames = out["frames"]
    a, b = body["start"], body["start"] + body["steps"]
    assert len(frames) == body["steps"] and [f["step"] for f in frames] == list(range(a, b))
    N, cap = trace.meta.num_experts, body["capacity"]
    resident = [set() for _ in range(trace.num_layers)]
    for f in frames:
        for li, ly in enumerate(f["layers"]):
            resident[li] = _check_layer(ly, resident[li], cap, N)
    # counted independently: the simulator on the same tokens (one sequence, caches carried)
    part = RoutingTrace(logits_TLE=np.asarray(trace.logits_TLE[a:b]), ids_TLK=np.asarray(trace.ids_TLK[a:b]),
                        meta=type(trace.meta)(**{**trace.meta.__dict__, "sequence_starts": [0]}))
    routing = RoutingConfig(**{k: v for k, v in body.items() if k in ("policy", "lam", "m")})
    if routing.policy == "original":
        expect = sim_replay(part.ids_TLK, N, cap, eviction=body["eviction"])
    else:
        expect = simulate(part, routing, cap, eviction=body["eviction"])
    for li, s in enumerate(expect.per_layer):
        assert sum(len(f["layers"][li]["miss"]) for f in frames) == s.misses
        assert sum(len(f["layers"][li]["hit"]) for f in frames) == s.hits
        assert out["result"]["per_layer"][li]["misses"] == s.misses
    if routing.policy == "original":  # fixed selections: the recorded ones, in order
        assert all(f["layers"][li]["requested"] == [int(e) for e in trace.ids_TLK[f["step"], li] if e >= 0]
                   for f in frames for li in range(trace.num_layers))
    assert frames[-1]["totals"]["hits"] + frames[-1]["totals"]["misses"] == sum(
        s.accesses for s in expect.per_layer)


@pytest.mark.parametrize("body,param", [
    ({"trace": "../../etc/passwd"}, "trace"),
    ({"trace": "/work/main/src/expertcache/assets/traces/" + TRACE}, "trace"),
    ({"trace": TRACE, "steps": 0}, "steps"),
    ({"trace": TRACE, "steps": 100000}, "steps"),
    ({"trace": TRACE, "capacity": 33}, "capacity"),
    ({"trace": TRACE, "start": 4096}, "start"),
    ({"trace": TRACE, "policy": "cache-prior", "lam": 0.5, "eviction": "belady"}, "eviction"),
    ({"trace": TRACE, "eviction": ["lru"]}, "eviction"),
    ({"trace": TRACE, "eviction": {"lru": 1}}, "eviction"),
    ({"trace": TRACE, "policy": "cache-prior", "lam": -1}, "lam"),
    ({"trace": TRACE, "top_j": 9}, "top_j"),
    ({"trace": TRACE, "speed": 2}, "speed"),
])
def test_bad_replays_get_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/expertcache/replay", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_trace_dir_adds_traces_and_the_cli_rejects_a_missing_one(tmp_path, capsys):
    shutil.copy(shipped_traces()[TRACE], tmp_path / "mine.trace.safetensors")
    (tmp_path / "notes.txt").write_text("not a trace")
    assert set(list_traces([tmp_path])) == {TRACE, "mine.trace.safetensors"}
    path, opts = parse_replay({"trace": "mine.trace.safetensors", "capacity": 4}, [tmp_path])
    assert path == tmp_path / "mine.trace.safetensors" and opts["capacity"] == 4
    with pytest.raises(ValueError, match="notes.txt"):
        parse_replay({"trace": "notes.txt"}, [tmp_path])
    from expertcache.cli.main import main

    assert main(["serve", "--trace-dir", str(tmp_path / "nope")]) == 2
    assert "--trace-dir" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# the page in headless Chromium


def _chromium():
    for b in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(b):
            return shutil.which(b)
    return None


@pytest.fixture(scope="module")
def browser():
    yield from _browser()


def _browser(*extra: str):
    binary, driver_path = _chromium(), shutil.which("chromedriver")
    missing = [n for n, p in (("chromium", binary), ("chromedriver", driver_path)) if p is None]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium")
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the browser tests: {missing} missing")
        pytest.skip(f"the browser tests need {missing}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1440,900",
              "--no-first-run", "--disable-extensions", "--disable-background-networking", *extra):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(options=opts, service=Service(driver_path))
    drv.set_page_load_timeout(30)
    yield drv
    drv.quit()


@pytest.fixture(scope="module")
def page(server, browser):
    _reset(server)
    browser.get(server.url + "/")
    _poll(lambda: browser.execute_script("return document.body.dataset.ready") == "1", "the page to start")
    yield browser
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def _poll(cond, what, timeout=30.0):
    t0 = time.monotonic()
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


GRID_JS = "return Array.from(document.querySelectorAll('#grid .cell')).map(c => c.className).join(',')"


def _console_errors(drv):
    return [e for e in drv.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


@pytest.mark.browser
def test_browser_page_loads_with_the_grid_and_no_console_errors(page):
    from selenium.webdriver.common.by import By

    cells = page.find_elements(By.CSS_SELECTOR, "#grid .cell")
    assert len(cells) == 4 * 32
    assert "original" in page.find_element(By.ID, "config").text
    _poll(lambda: page.find_element(By.ID, "conn").text == "live", "the event stream")
    assert not _console_errors(page)


@pytest.mark.browser
def test_browser_prompt_streams_text_and_the_grid_changes_during_generation(page, server, tmp_path):
    from selenium.webdriver.common.by import By

    # a change made elsewhere (here: over HTTP) reaches the page as a config event
    httpx.post(server.url + "/v1/expertcache/config", json={"policy": "cache-prior", "lam": 0.5})
    _poll(lambda: "cache-prior(lam=0.5,J=1)" in page.find_element(By.ID, "config").text, "the config event")
    assert page.find_element(By.ID, "strength-value").text == "0.5"
    prompt = page.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys("In 1990 the city of")
    n = page.find_element(By.ID, "max-tokens")
    n.clear()
    n.send_keys("64")
    drawn0 = int(page.execute_script("return document.body.dataset.drawn || '0'"))
    page.find_element(By.ID, "generate").click()
    lengths, grids, shot = [], set(), None
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        text = page.find_element(By.ID, "output").text
        grids.add(page.execute_script(GRID_JS))
        lengths.append(len(text))
        if shot is None and len(text) > 40:
            shot = Path(os.environ.get("EXPERTCACHE_LIVEVIEW_SCREENSHOT") or tmp_path / "liveview.png")
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.save_screenshot(str(shot))
        if page.execute_script("return document.body.dataset.generating") == "0":
            break
    status = page.find_element(By.ID, "gen-status").text
    assert "tokens" in status and "hit rate" in status, status
    final = page.find_element(By.ID, "output").text
    assert len(final) > 20
    partial = {x for x in lengths if 0 < x < len(final)}
    assert len(partial) >= 2, "the text did not stream (no partial states seen)"
    assert len(grids) >= 3, "the grid did not change during generation"
    assert any("c-hit" in g for g in grids) and any("c-miss" in g for g in grids)
    assert int(page.execute_script("return document.body.dataset.drawn")) - drawn0 >= 3
    for fig in ("tok-s", "hit-rate", "bytes-tok"):
        assert page.find_element(By.ID, fig).text not in ("", "–"), fig
    assert shot is not None and shot.stat().st_size > 10_000
    # a cache-aware policy is shown against original routing on the same tokens
    assert page.find_element(By.ID, "orig-box").is_displayed()
    assert page.find_element(By.ID, "orig-rate").text.endswith("%")
    _reset(server)
    assert not _console_errors(page)


@pytest.mark.browser
def test_browser_lambda_control_changes_the_configuration_the_server_reports(page, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(page.find_element(By.ID, "policy")).select_by_value("cache-prior")
    _poll(lambda: httpx.get(server.url + "/v1/expertcache/config").json()["routing"]["policy"] == "cache-prior",
          "the policy to reach the server")
    assert page.find_element(By.ID, "strength-name").text == "λ"
    slider = page.find_element(By.ID, "strength")
    page.execute_script("arguments[0].value = '0.65'; arguments[0].dispatchEvent(new Event('input'));"
                        "arguments[0].dispatchEvent(new Event('change'));", slider)
    _poll(lambda: httpx.get(server.url + "/v1/expertcache/config").json()["routing"]["lam"] == 0.65,
          "λ to reach the server")
    assert server.app.state.engine.rt.routing.lam == 0.65
    _poll(lambda: "cache-prior(lam=0.65,J=1)" in page.find_element(By.ID, "config").text, "the page to show it")
    # a refused value shows the server's error and changes nothing
    cap = page.find_element(By.ID, "capacity")
    page.execute_script("arguments[0].value = '99'; arguments[0].dispatchEvent(new Event('change'));", cap)
    _poll(lambda: "capacity" in page.find_element(By.ID, "config-error").text, "the error")
    assert httpx.get(server.url + "/v1/expertcache/config").json()["capacity"] == C
    _reset(server)
    errors = [e for e in page.get_log("browser") if e["level"] == "SEVERE"]
    assert all("400" in e["message"] for e in errors), errors  # the refused POST itself, nothing else


@pytest.mark.browser
def test_browser_trace_replays_on_the_grid(page):
    from selenium.webdriver.common.by import By

    page.find_element(By.ID, "tab-replay").click()
    _poll(lambda: page.find_elements(By.CSS_SELECTOR, "#trace-select option"), "the trace list")
    steps = page.find_element(By.ID, "replay-steps")
    steps.clear()
    steps.send_keys("48")
    page.execute_script("document.getElementById('replay-speed').value = '60'")
    page.find_element(By.ID, "replay-load").click()
    seen = set()

    def advanced():
        seen.add(page.execute_script(GRID_JS))
        return int(page.execute_script("return document.body.dataset.replayStep || '-1'")) >= 20

    _poll(advanced, "the replay to step")
    assert len(seen) >= 3
    assert "miss rate" in page.find_element(By.ID, "replay-status").text
    page.find_element(By.ID, "tab-live").click()
    assert not _console_errors(page)


# ---------------------------------------------------------------------------------------------------------
# issue 24: the layout at 1280 px, refused values, per-tab errors, client tok/s, the API key, other origins


def _severe(drv):
    return [e for e in drv.get_log("browser") if e["level"] == "SEVERE"]


@pytest.mark.browser
def test_browser_grid_fits_1280px_up_to_64_experts_then_wraps_with_the_label(page):
    page.set_window_size(1280, 800)
    try:
        js = """
          buildGrid(4, arguments[0]);
          const W = document.documentElement.clientWidth;
          return Array.from(document.querySelectorAll('#grid .layer')).map(row => {
            const cells = Array.from(row.querySelectorAll('.cell'));
            const label = row.querySelector('.name');
            return {tops: [...new Set(cells.map(c => Math.round(c.getBoundingClientRect().top)))].length,
                    right: Math.max(...cells.map(c => c.getBoundingClientRect().right)), W: W,
                    minWidth: Math.min(...cells.map(c => c.getBoundingClientRect().width)),
                    label: label.textContent, labelVisible: label.getBoundingClientRect().width > 0,
                    n: cells.length};
          });"""
        for n in (32, 64):
            rows = page.execute_script(js, n)
            assert len(rows) == 4
            for r in rows:
                assert r["n"] == n and r["tops"] == 1, (n, r)  # one line per layer
                assert r["right"] <= r["W"] and r["minWidth"] >= 3, (n, r)  # inside the window, visible cells
                assert r["labelVisible"] and r["label"].startswith("layer ")
        assert page.execute_script("return document.documentElement.scrollWidth <= "
                                   "document.documentElement.clientWidth")
        for r in page.execute_script(js, 128):  # above 64: lines of 64, the label kept
            assert r["n"] == 128 and r["tops"] == 2 and r["labelVisible"] and r["right"] <= r["W"], r
    finally:
        page.execute_script("buildGrid(state.config.moe_layers, state.config.num_experts)")
        page.set_window_size(1440, 900)


@pytest.mark.browser
def test_browser_refused_values_reset_and_each_tab_keeps_its_own_error(page, server):
    from selenium.webdriver.common.by import By

    _reset(server)
    page.find_element(By.ID, "tab-live").click()
    cap = page.find_element(By.ID, "capacity")
    page.execute_script("arguments[0].value = '99'; arguments[0].dispatchEvent(new Event('change'));", cap)
    _poll(lambda: "capacity" in page.find_element(By.ID, "config-error").text, "the live error")
    assert cap.get_attribute("value") == str(C)  # the refused value went back to what the server uses
    live_error = page.find_element(By.ID, "config-error").text
    page.find_element(By.ID, "tab-replay").click()
    assert page.find_element(By.ID, "config-error").text == ""  # the live tab's error stays with it
    _poll(lambda: page.find_elements(By.CSS_SELECTOR, "#trace-select option"), "the trace list")
    page.execute_script("arguments[0].value = '99'", cap)
    page.find_element(By.ID, "replay-load").click()
    _poll(lambda: "capacity" in page.find_element(By.ID, "config-error").text, "the replay error")
    assert cap.get_attribute("value") == str(C)
    steps = page.find_element(By.ID, "replay-steps")
    last_good = page.execute_script("return state.replayAccepted ? String(state.replayAccepted.steps) : '128'")
    steps.clear()
    steps.send_keys("5000")
    page.find_element(By.ID, "replay-load").click()
    _poll(lambda: "steps" in page.find_element(By.ID, "config-error").text, "the replay's steps error")
    replay_error = page.find_element(By.ID, "config-error").text
    assert steps.get_attribute("value") == last_good  # back to the last accepted replay's (or the default)
    page.find_element(By.ID, "replay-load").click()  # the next replay works with the reset values
    _poll(lambda: "miss rate" in page.find_element(By.ID, "replay-status").text, "the next replay")
    assert page.find_element(By.ID, "config-error").text == ""
    page.find_element(By.ID, "tab-live").click()
    assert page.find_element(By.ID, "config-error").text == live_error != replay_error
    page.find_element(By.ID, "tab-replay").click()
    assert page.find_element(By.ID, "config-error").text == ""  # the replay tab's error was cleared by its success
    page.find_element(By.ID, "tab-live").click()
    errors = _severe(page)
    assert all("400" in e["message"] for e in errors), errors  # the refused requests, nothing else


LAYOUT_JS = """
  const r = s => document.querySelector(s).getBoundingClientRect();
  const figs = Array.from(document.querySelectorAll('.figures > div')).filter(d => d.offsetParent);
  const cells = Array.from(document.querySelectorAll('#grid .cell'));
  return {left: r('#left').width, right: r('#right').right, figures: figs.length,
          figureLines: new Set(figs.map(d => Math.round(d.getBoundingClientRect().top))).size,
          gridRight: Math.max(...cells.map(c => c.getBoundingClientRect().right)),
          orig: !document.getElementById('orig-box').classList.contains('hidden'),
          stepNo: document.getElementById('step-no').textContent,
          noScroll: document.documentElement.scrollWidth <= document.documentElement.clientWidth};"""


@pytest.mark.browser
@pytest.mark.parametrize("width", [1280, 1920])
def test_browser_layout_at_1280_and_1920_and_live_comes_back_as_it_was_after_replay(page, server, width):
    """The figures stay on one line with the original-routing figure shown (it wrapped at 1280 px); the grid
    fills the right column (at 1920 px cells capped at 22 px left half of it empty); the left column keeps its
    width in Replay (it widened); back on Live the page shows the live frames' count and grid (it kept the
    replay's step counter and cells until the next forward)."""
    from selenium.webdriver.common.by import By

    page.set_window_size(width, 900)
    try:
        httpx.post(server.url + "/v1/expertcache/config", json={"policy": "cache-prior", "lam": 0.5})
        page.find_element(By.ID, "tab-live").click()
        _complete(server, n=12)
        _poll(lambda: page.execute_script(LAYOUT_JS)["orig"], "the original-routing figure")
        live = page.execute_script(LAYOUT_JS)
        assert live["figures"] == 7 and live["figureLines"] == 1, live
        assert live["gridRight"] >= live["right"] - 24 and live["noScroll"], live  # the grid fills its column
        live_grid = page.execute_script(GRID_JS)
        page.find_element(By.ID, "tab-replay").click()
        _poll(lambda: page.find_elements(By.CSS_SELECTOR, "#trace-select option"), "the trace list")
        page.find_element(By.ID, "replay-load").click()
        _poll(lambda: "/" in page.execute_script(LAYOUT_JS)["stepNo"], "the replay")
        _poll(lambda: page.execute_script(GRID_JS) != live_grid, "a replay frame on the grid")
        replay = page.execute_script(LAYOUT_JS)
        assert replay["left"] == live["left"] and replay["figureLines"] == 1, (live, replay)
        page.find_element(By.ID, "replay-play").click()  # paused: nothing repaints the replay meanwhile
        frames = page.execute_script("return String(state.frames)")
        page.find_element(By.ID, "tab-live").click()
        back = page.execute_script(LAYOUT_JS)
        assert back["stepNo"] == frames and back["left"] == live["left"], (frames, back)
        assert page.execute_script(GRID_JS) == page.execute_script(
            "paintLayers(state.live.layers); return " + GRID_JS[len("return "):])  # the newest live frame's cells
    finally:
        _reset(server)
        page.set_window_size(1440, 900)


@pytest.mark.browser
@pytest.mark.parametrize("field, param", [("top-j", "top_j"), ("capacity", "capacity")])
def test_browser_an_emptied_number_field_is_refused_on_the_page_not_sent_as_0(page, server, field, param):
    from selenium.webdriver.common.by import By

    _reset(server)
    page.find_element(By.ID, "tab-live").click()
    _poll(lambda: page.find_element(By.ID, "capacity").get_attribute("value") == str(C), "the reset controls")
    version = httpx.get(server.url + "/v1/expertcache/config").json()["version"]
    el = page.find_element(By.ID, field)
    before = el.get_attribute("value")
    page.execute_script("arguments[0].value = ''; arguments[0].dispatchEvent(new Event('change'));", el)
    _poll(lambda: page.find_element(By.ID, "config-error").text, "the page's error")
    assert page.find_element(By.ID, "config-error").text == f"{param}: enter a number"
    assert el.get_attribute("value") == before  # back to what the server uses
    assert httpx.get(server.url + "/v1/expertcache/config").json()["version"] == version  # nothing was sent
    page.execute_script("arguments[0].dispatchEvent(new Event('change'));", el)  # the next change works
    _poll(lambda: page.find_element(By.ID, "config-error").text == "", "the error to clear")


@pytest.mark.browser
def test_browser_shows_the_clients_own_tok_s_next_to_the_engines(page, server):
    from selenium.webdriver.common.by import By

    page.find_element(By.ID, "tab-live").click()
    n = page.find_element(By.ID, "max-tokens")
    n.clear()
    n.send_keys("24")
    page.find_element(By.ID, "generate").click()
    _poll(lambda: page.execute_script("return document.body.dataset.generating") == "0"
          and "tokens" in page.find_element(By.ID, "gen-status").text, "the generation")
    client = float(page.find_element(By.ID, "client-tok-s").text)
    engine = float(page.find_element(By.ID, "tok-s").text)
    assert client > 0 and engine > 0
    assert "this page" in page.find_element(By.ID, "client-tok-s").find_element(By.XPATH, "..").text


@pytest.fixture(scope="module")
def keyed_server():
    tok = load_tokenizer(resolve_model_path("granular"))
    rt = OffloadedModel.from_pretrained("granular", OffloadConfig(io="cached", capacity=C))
    engine = Engine(rt, tok, max_batch=2, max_queue=4).start()
    srv = ServerThread(create_app(engine, "granular", tokenizer=tok, api_key="k-123")).start()
    yield srv
    srv.stop()
    engine.shutdown(0)


@pytest.mark.browser
def test_browser_live_view_asks_for_the_api_key_and_works_with_it(browser, keyed_server):
    from selenium.webdriver.common.by import By

    browser.get(keyed_server.url + "/")
    _poll(lambda: browser.find_element(By.ID, "auth").is_displayed(), "the key prompt")
    assert browser.execute_script("return document.body.dataset.ready") is None
    box = browser.find_element(By.ID, "api-key")
    box.send_keys("wrong")
    browser.find_element(By.ID, "auth-ok").click()
    _poll(lambda: "refused" in browser.find_element(By.ID, "auth-msg").text, "the refusal")
    box.clear()
    box.send_keys("k-123")
    browser.find_element(By.ID, "auth-ok").click()
    _poll(lambda: browser.execute_script("return document.body.dataset.ready") == "1", "the page to start")
    _poll(lambda: browser.find_element(By.ID, "conn").text == "live", "the event stream (key as ?api_key=)")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#grid .cell")) == 4 * 32
    n = browser.find_element(By.ID, "max-tokens")
    n.clear()
    n.send_keys("8")
    browser.find_element(By.ID, "generate").click()
    _poll(lambda: "tokens" in browser.find_element(By.ID, "gen-status").text, "a generation with the key")
    assert len(browser.find_element(By.ID, "output").text) > 0
    errors = _severe(browser)
    assert errors and all("401" in e["message"] for e in errors), errors  # only the refused key's requests


ATTACK_PAGE = """<!doctype html><html><body><script>
(async () => {
  const target = location.hash.slice(1), out = {};
  const body = JSON.stringify({policy: "original", capacity: 2});
  try {  // a "simple" request: no preflight, the browser sends it (and its Origin) as is
    await fetch(target + "/v1/expertcache/config", {method: "POST", mode: "no-cors", body: body,
      headers: {"Content-Type": "text/plain"}});
    out.simple = "sent";
  } catch (e) { out.simple = "failed: " + e; }
  try {  // JSON: needs a CORS preflight the server does not grant
    const r = await fetch(target + "/v1/expertcache/config", {method: "POST", body: body,
      headers: {"Content-Type": "application/json"}});
    out.json = "status " + r.status;
  } catch (e) { out.json = "failed"; }
  try {
    await fetch(target + "/v1/expertcache/replay", {method: "POST", mode: "no-cors", body: body,
      headers: {"Content-Type": "text/plain"}});
  } catch (e) {}
  document.body.dataset.done = JSON.stringify(out);
})();
</script></body></html>"""


@pytest.mark.browser
def test_browser_a_page_of_another_origin_cannot_steer_the_server(browser, server, tmp_path):
    import functools
    import http.server

    _reset(server)
    before = httpx.get(server.url + "/v1/expertcache/config").json()
    (tmp_path / "attack.html").write_text(ATTACK_PAGE)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a, **k: None
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # another loopback port: another origin
    threading.Thread(target=other.serve_forever, daemon=True).start()
    refused0 = _refused(server)
    try:
        browser.get(f"http://127.0.0.1:{other.server_address[1]}/attack.html#{server.url}")
        done = _poll(lambda: browser.execute_script("return document.body.dataset.done"), "the attack page")
    finally:
        other.shutdown()
        other.server_close()
    out = json.loads(done)
    assert out["json"] == "failed", out  # the preflight is not granted
    after = httpx.get(server.url + "/v1/expertcache/config").json()
    assert after["capacity"] == before["capacity"] == C and after["routing"] == before["routing"]
    assert after["version"] == before["version"]
    _wait(lambda: _refused(server) >= refused0 + 2, what="the refusals to be counted")  # config + replay: 403
    _severe(browser)


def _refused(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("expertcache_requests_total") and 'status="403"' in line)


# ---------------------------------------------------------------------------------------------
# DNS rebinding (issue 24): Chromium resolves rebind.test to 127.0.0.1, as an attacker's DNS would


@pytest.fixture(scope="module")
def rebinding_browser():
    yield from _browser("--host-resolver-rules=MAP rebind.test 127.0.0.1")


REBIND_PAGE_JS = """
const done = arguments[arguments.length - 1];
fetch('/v1/expertcache/config', {method: 'POST', headers: {'Content-Type': 'application/json'},
                                body: JSON.stringify({policy: 'original'})})
  .then(r => r.text().then(t => done(JSON.stringify({status: r.status, body: t}))))
  .catch(e => done(JSON.stringify({status: 'failed', body: String(e)})));
"""


@pytest.mark.browser
def test_browser_dns_rebinding_reaches_nothing_on_a_loopback_server(rebinding_browser, server):
    """A page loaded as http://rebind.test:PORT/ is same-origin with the server it was re-pointed at: the
    Origin check alone lets its script POST. The loopback Host list (what `expertcache serve` sets) refuses
    the page and the script; the unlisted test server shows the name really reaches 127.0.0.1."""
    from expertcache.cli.serve import allowed_hosts

    drv = rebinding_browser
    tok = load_tokenizer(resolve_model_path("granular"))
    rt = OffloadedModel.from_pretrained("granular", OffloadConfig(io="cached", capacity=C))
    engine = Engine(rt, tok, max_batch=2, max_queue=4).start()
    guarded = ServerThread(create_app(engine, "granular", tokenizer=tok,
                                      allowed_hosts=allowed_hosts("127.0.0.1", []))).start()
    try:
        before = httpx.get(guarded.url + "/v1/expertcache/config").json()
        drv.get(f"http://rebind.test:{guarded.port}/")
        assert "host_not_allowed" in drv.page_source
        out = json.loads(drv.execute_async_script(REBIND_PAGE_JS))
        assert out["status"] == 403 and "host_not_allowed" in out["body"], out
        assert httpx.get(guarded.url + "/v1/expertcache/config").json() == before
    finally:
        guarded.stop()
        engine.shutdown(0)
    drv.get(f"http://rebind.test:{server.port}/")  # the control: no list, the rebound name gets the page
    _poll(lambda: drv.execute_script("return document.body.dataset.ready") == "1", "the unguarded page")
