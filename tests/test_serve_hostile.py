"""`expertcache serve` against hostile and careless clients (issue 33): no request stops, stalls or locks out the
server. Servers on 127.0.0.1 only, on ephemeral ports; every count and loop is bounded.

Each case checks the status the client gets, that the engine is alive afterwards (the next request succeeds,
``/health`` ok) and, where the case used to stall others, that a running stream's largest token gap stays
bounded (a generous bound here, 2 s on this shared 2-core machine; the measured gaps are in docs/SERVE.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from expertcache.offload import OffloadConfig, OffloadedModel  # noqa: E402
from expertcache.offload.runtime import resolve_model_path  # noqa: E402
from expertcache.serve.app import create_app  # noqa: E402
from expertcache.serve.engine import Engine, SamplingParams, sample_next  # noqa: E402
from expertcache.serve.server import ServerThread  # noqa: E402
from expertcache.train.tokenizer import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

C = 8


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_path("granular"))


def _runtime():
    return OffloadedModel.from_pretrained("granular", OffloadConfig(io="cached", capacity=C))


@contextlib.contextmanager
def _server(tok, **kw):
    engine = Engine(_runtime(), tok, max_batch=8, max_queue=64, prefill_chunk=128).start()
    srv = ServerThread(create_app(engine, "granular", tokenizer=tok, **kw)).start()
    try:
        yield srv
    finally:
        srv.stop()
        engine.shutdown(0)


@pytest.fixture(scope="module")
def server(tok):
    with _server(tok) as srv:
        yield srv


def _post(srv, body, path="/v1/completions", **kw):
    return httpx.post(srv.url + path, json=body, timeout=kw.pop("timeout", 120), **kw)


def _ok(srv):
    """The engine is alive: a request succeeds and /health says ok."""
    r = _post(srv, {"model": "granular", "prompt": "The kernel", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    h = httpx.get(srv.url + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["status"] == "ok", h.text


def _greedy(srv, prompt="The kernel", n=6):
    r = _post(srv, {"model": "granular", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["expertcache"]["token_ids"]


# ---------------------------------------------------------------------------------------------
# one request must not stop the engine


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1e-300), (0.7, 1e-320), (1e-300, 1.0), (5e-324, 0.5),
                                                (1e-45, 1e-300), (2.0, 1e-46)])
def test_extreme_sampling_values_sample_the_limit_and_the_engine_goes_on(server, temperature, top_p):
    """T -> 0 and a nucleus of mass -> 0 both tend to the most likely token: the greedy tokens (temperature 0)
    computed by the argmax path, independently of the sampling path. Used to 500 and stop the engine."""
    want = _greedy(server)
    r = _post(server, {"model": "granular", "prompt": "The kernel", "max_tokens": 6, "temperature": temperature,
                       "top_p": top_p, "ignore_eos": True, "return_token_ids": True, "seed": 1})
    assert r.status_code == 200, r.text
    if temperature < 1e-30 or top_p < 1e-40:  # both limits are the argmax (top_p: one token's mass is > 1e-40)
        assert r.json()["expertcache"]["token_ids"] == want
    _ok(server)


def test_sample_next_limits_equal_the_argmax_on_random_logits():
    g = torch.Generator().manual_seed(0)
    for i in range(50):
        z = torch.randn(300, generator=g) * (1 + i)
        z[i] = float("-inf")  # a masked logit stays impossible
        best = int(z.argmax())
        for t, p in ((1e-300, 1.0), (5e-324, 1.0), (0.7, 1e-300), (2.0, 5e-324), (1e-39, 0.3)):
            assert sample_next(z, SamplingParams(1, t, p), torch.Generator().manual_seed(i)) == best
    # an ordinary temperature still samples (not collapsed to the argmax): several tokens over 64 draws
    z = torch.zeros(50)
    seen = {sample_next(z, SamplingParams(1, 1.0, 1.0), torch.Generator().manual_seed(s)) for s in range(64)}
    assert len(seen) > 10


class _Poisoned:
    """The model, failing a forward whose input holds ``poison`` (a prefill) or, once armed, the next decode
    forward (``[B, 1]`` inputs)."""

    def __init__(self, model, poison: int) -> None:
        self.model, self.poison, self.fail_decode = model, poison, 0
        self.config = model.config

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, **kw):
        ids = kw["input_ids"]
        if bool((ids == self.poison).any()):
            raise RuntimeError("poisoned prompt")
        if ids.shape[1] == 1 and self.fail_decode:
            self.fail_decode -= 1
            raise RuntimeError("poisoned decode step")
        return self.model(**kw)


def test_a_failing_request_fails_alone_and_the_engine_goes_on(tok):
    rt = _runtime()
    POISON = 77
    rt.model = _Poisoned(rt.model, POISON)
    engine = Engine(rt, tok, max_batch=4).start()
    srv = ServerThread(create_app(engine, "granular", tokenizer=tok)).start()
    try:
        # a prefill that fails: that request gets a 500 naming the error, the next one succeeds
        r = _post(srv, {"model": "granular", "prompt": [5, POISON, 9], "max_tokens": 4})
        assert r.status_code == 500 and "poisoned prompt" in r.json()["error"]["message"], r.text
        _ok(srv)
        # a decode forward that fails: its rows get a 500; the engine decodes the next request
        rt.model.fail_decode = 1
        r = _post(srv, {"model": "granular", "prompt": "The kernel", "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 500 and "poisoned decode step" in r.json()["error"]["message"], r.text
        _ok(srv)
        # a failure while sampling one row (seed 4242 here): that row alone; the stream beside it finishes
        import expertcache.serve.engine as engine_mod

        real = engine_mod.sample_next

        def sample(logits_V, p, gen):
            if p.seed == 4242:
                raise ValueError("unsampleable")
            return real(logits_V, p, gen)

        engine_mod.sample_next = sample
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                    "model": "granular", "prompt": "Once upon a time", "max_tokens": 20, "stream": True,
                    "ignore_eos": True, "seed": 1}) as s:
                lines = s.iter_lines()
                first = [next(lines) for _ in range(2)]
                r = _post(srv, {"model": "granular", "prompt": "The", "max_tokens": 4, "seed": 4242})
                rest = [ln for ln in lines if ln.startswith("data: ")]
        finally:
            engine_mod.sample_next = real
        assert r.status_code == 500 and "unsampleable" in r.json()["error"]["message"], r.text
        assert first[0].startswith("data: ") and rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        _ok(srv)
        assert engine.error is None and engine.totals["failed"] >= 2
    finally:
        srv.stop()
        engine.shutdown(0)


# ---------------------------------------------------------------------------------------------
# lock-out: half-sent requests, more connections than file descriptors


@contextlib.contextmanager
def _serve_process(argv, nofile: int | None = None):
    """``expertcache serve --port 0 *argv`` in a subprocess on 127.0.0.1 (one torch thread; ``nofile``: its
    RLIMIT_NOFILE, soft and hard), stderr to a file: yields (process, base URL, stderr path)."""
    import tempfile

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("EXPERTCACHE_API_KEY", None)
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)

    def limit():
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen([sys.executable, "-m", "expertcache.cli.main", "serve", "--host", "127.0.0.1",
                             "--port", "0", "--io", "cached", "--cache-experts", "8", "--threads", "1", *argv],
                            stderr=log, stdout=subprocess.DEVNULL, env=env, preexec_fn=limit)
    try:
        t0 = time.monotonic()
        url = None
        while url is None:
            assert proc.poll() is None, open(log.name).read()
            assert time.monotonic() - t0 < 120, "serve did not start"
            text = open(log.name).read()
            if " on http://127.0.0.1:" in text:
                url = text.split(" on ", 1)[1].split("/v1")[0]
            else:
                time.sleep(0.1)
        yield proc, url, log.name
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)


def _half_open(port: int, n: int) -> list[socket.socket]:
    """The benchmark's attack (benchmarks/bench_serve_hostile.py: half_open_sockets)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from bench_serve_hostile import half_open_sockets
    finally:
        sys.path.pop(0)
    return half_open_sockets(port, n)


def test_1100_half_open_connections_never_lock_out_health(tmp_path):
    """A server limited to 1,024 file descriptors, 1,100 connections that each send half a request: /health
    answers within 2 s throughout (the 1,100 are refused or timed out, not waited for), the log grows by at
    most 1 MB (no traceback per refused accept), a request afterwards succeeds. Used to time out for 70 s and
    write 140 MB of 'Too many open files'."""
    with _serve_process(["--header-timeout", "3"], nofile=1024) as (proc, url, log):
        port = int(url.rsplit(":", 1)[1])
        size0 = os.path.getsize(log)
        socks = []
        worst = 0.0
        try:
            t_end = time.monotonic() + 8
            socks += _half_open(port, 1100)
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                h = httpx.get(url + "/health", timeout=10)
                worst = max(worst, time.monotonic() - t0)
                assert h.status_code == 200, h.text
                time.sleep(0.25)
        finally:
            for s in socks:
                s.close()
        grown = os.path.getsize(log) - size0
        print(f"1,100 half-open connections: slowest /health {worst:.3f} s, log +{grown} bytes")
        assert worst < 2.0, f"/health took {worst:.2f} s"
        assert grown < 1 << 20, f"the log grew by {grown} bytes"
        r = httpx.post(url + "/v1/completions", timeout=60, json={"model": "granular", "prompt": "The", "max_tokens": 2})
        assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------
# bodies: one size limit for every route, chunked or not; a depth limit; a timeout; a client that leaves


def _chunked(n_bytes: int, piece: int = 1 << 16):
    def gen():
        yield b'{"trace": "'
        sent = 0
        while sent < n_bytes:
            yield b"x" * piece
            sent += piece
        yield b'"}'
    return gen()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/expertcache/config",
                                  "/v1/expertcache/replay"])
def test_a_chunked_body_over_the_limit_gets_413_on_every_route(server, path):
    """Chunked bodies have no Content-Length: the limit counts bytes as they arrive (config and replay read
    50 MB before)."""
    r = httpx.post(server.url + path, content=_chunked(4 << 20), headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413, (r.status_code, r.text[:200])
    assert "--max-request-bytes" in r.json()["error"]["message"]
    _ok(server)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/expertcache/config",
                                  "/v1/expertcache/replay"])
def test_json_nested_200000_deep_gets_400_on_every_route(server, path):
    raw = b"[" * 200_000 + b"]" * 200_000
    r = httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "nested deeper than" in r.json()["error"]["message"], r.text[:300]
    _ok(server)


def test_a_slow_body_gets_408_and_a_client_gone_mid_body_is_no_500(tok):
    with _server(tok, body_timeout=1.0) as srv:
        port = srv.port
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\"")
        s.settimeout(10)
        head = s.recv(4096).decode("latin-1")
        s.close()
        assert head.startswith("HTTP/1.1 408"), head
        # 20 clients that send half a body and leave: 499s counted, no 500, no traceback
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\"")
            s.close()
        time.sleep(0.5)
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'route="/v1/completions",status="500"' not in metrics
        assert 'route="/v1/completions",status="499"} 20.0' in metrics, metrics
        _ok(srv)


# ---------------------------------------------------------------------------------------------
# chat messages as strict as the top level; a template the sandbox refuses


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user", "content": "hi", "foo": 1}], "messages[0].foo"),
    ([{"role": "user", "content": "hi", "tool_calls": [{"id": "x"}]}], "messages[0].tool_calls"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
     "messages[0].content[0].cache_control"),
    ([{"role": "assistant", "content": "a", "tool_calls": [{"id": "x"}]}], "messages[0].tool_calls"),
    ([{"role": "user", "content": "hi", "name": 3}], "messages[0].name"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
])
def test_unknown_or_unsupported_message_keys_get_400_naming_them(server, messages, param):
    r = _post(server, {"model": "granular", "messages": messages, "max_tokens": 2}, path="/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert param in r.json()["error"]["message"]


def test_documented_message_keys_are_accepted(server):
    msgs = [{"role": "system", "content": "Be brief.", "name": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
            {"role": "assistant", "content": "hello", "tool_calls": [], "refusal": None},
            {"role": "user", "content": "and?"}]
    r = _post(server, {"model": "granular", "messages": msgs, "max_tokens": 2}, path="/v1/chat/completions")
    assert r.status_code == 200, r.text


def test_a_template_the_sandbox_refuses_is_a_400_naming_the_template(tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"  # the sandbox refuses attribute access
    with _server(t) as srv:
        r = _post(srv, {"model": "granular", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                  path="/v1/chat/completions")
        assert r.status_code == 400, r.text
        e = r.json()["error"]
        assert e["param"] == "messages" and "chat template" in e["message"] and "SecurityError" in e["message"]
        _ok(srv)


# ---------------------------------------------------------------------------------------------
# 503 while draining says when to retry; keys and hosts that mean nothing are refused


def test_503s_while_draining_carry_retry_after(tok):
    from expertcache.serve.app import begin_shutdown

    engine = Engine(_runtime(), tok, max_batch=1)  # never started: the request waits
    srv = ServerThread(create_app(engine, "granular", tokenizer=tok)).start()
    try:
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", _post(srv, {"model": "granular", "prompt": "The"})))
        t.start()
        t0 = time.monotonic()
        while engine.queue_length() < 1 and time.monotonic() - t0 < 30:
            time.sleep(0.02)
        begin_shutdown(srv.app, 0)
        t.join(30)
        for r in (out["r"], _post(srv, {"model": "granular", "prompt": "The"}), httpx.get(srv.url + "/health")):
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, (r.status_code, r.headers)
    finally:
        srv.stop()


@pytest.mark.parametrize("argv, env_key, culprit", [
    ([], "", "$EXPERTCACHE_API_KEY"),
    ([], "  ", "$EXPERTCACHE_API_KEY"),
    (["--host", ""], None, "--host"),
    (["--host", " "], None, "--host"),
    (["--header-timeout", "0"], None, "--header-timeout"),
    (["--body-timeout", "nan"], None, "--body-timeout"),
    (["--max-connections", "0"], None, "--max-connections"),
])
def test_empty_api_key_and_host_are_refused_before_binding(argv, env_key, culprit, capsys, monkeypatch):
    """Refused before any socket: ``bind`` is replaced by one that fails the test, so that even a server
    without the checks never listens (an empty --host used to mean every interface)."""
    import expertcache.serve.server as server_mod
    from expertcache.cli.main import main

    def no_bind(host, port):
        raise AssertionError(f"serve bound {host!r}:{port} before refusing {argv or env_key!r}")

    monkeypatch.setattr(server_mod, "bind", no_bind)

    if env_key is None:
        monkeypatch.delenv("EXPERTCACHE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("EXPERTCACHE_API_KEY", env_key)
    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1 and culprit in lines[0] and "Traceback" not in err, err


# ---------------------------------------------------------------------------------------------
# the live view: subscribers bounded and dropped when stalled; traces that are not files; replays off the loop


def test_event_subscribers_are_bounded_and_a_stalled_one_is_dropped(server):
    import asyncio

    from expertcache.serve.liveview import Broker, TimedStream

    b = Broker(maxlen=4, max_subscribers=2, stall_s=0.2)
    loop = asyncio.new_event_loop()
    try:
        s1, s2 = b.subscribe(loop), b.subscribe(loop)
        assert s1 is not None and s2 is not None and b.subscribe(loop) is None  # the third: refused
        for i in range(4):
            b.publish({"seq": i})
        s2.take()  # s2 reads, s1 never does
        time.sleep(0.3)
        b.publish({"seq": 4})
        assert b.subscribers == [s1, s2] and not s1.stalled  # full only now: not yet stalled for 0.2 s
        time.sleep(0.3)
        s2.take()
        b.publish({"seq": 5})
        assert b.subscribers == [s2] and s1.stalled and b.stalled == 1  # full and unread for 0.3 s: dropped
        assert b.subscribe(loop) is not None  # its place is free again

        # a client that stopped reading blocks the write: the stream gives up after send_timeout
        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n"

        sent = []

        async def send(msg):
            if msg["type"] == "http.response.body" and len(sent) == 2:  # after the head and one chunk
                await asyncio.sleep(3600)  # the socket is full
            sent.append(msg)

        sub = b.subscribe(loop) or s2
        t0 = time.monotonic()
        loop.run_until_complete(TimedStream(chunks(), sub, send_timeout=0.2)(None, None, send))
        assert time.monotonic() - t0 < 2 and sub.stalled and [m["type"] for m in sent] == [
            "http.response.start", "http.response.body"]
    finally:
        loop.close()
    # over HTTP: the 17th page gets a 429 with Retry-After, the others keep streaming
    from expertcache.serve.liveview import MAX_SUBSCRIBERS

    socks = []
    try:
        for _ in range(MAX_SUBSCRIBERS):
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"GET /v1/expertcache/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            socks.append(s)
        lv = server.app.state.liveview
        t0 = time.monotonic()
        while len(lv["broker"].subscribers) < MAX_SUBSCRIBERS and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        r = httpx.get(server.url + "/v1/expertcache/events", timeout=10)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
        _ok(server)
    finally:
        for s in socks:
            s.close()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_named_like_a_trace_is_refused_without_blocking(tok, tmp_path):
    from expertcache.serve.liveview import list_traces, load_regular_trace

    fifo = tmp_path / "stuck.trace.safetensors"
    os.mkfifo(fifo)
    assert "stuck.trace.safetensors" not in list_traces([tmp_path])  # not offered
    t0 = time.monotonic()
    with pytest.raises(OSError, match="stuck.trace.safetensors is not a regular file"):
        load_regular_trace(fifo)  # a FIFO swapped in after the listing: refused at once, never opened blocking
    assert time.monotonic() - t0 < 1
    with _server(tok, trace_dirs=(tmp_path,)) as srv:
        r = httpx.post(srv.url + "/v1/expertcache/replay", json={"trace": "stuck.trace.safetensors"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "trace", r.text
        _ok(srv)


def test_the_replay_child_returns_the_in_process_replay_and_leaves_registered_policies_to_the_server():
    """The child process replays exactly what :func:`replay_frames` computes here; a policy registered only in
    this process is unknown there (None: the route replays it in a thread)."""
    from test_registry_extension import TOY  # the toy policy of issue 25

    from expertcache.routing.registry import registered_policy
    from expertcache.serve.liveview import parse_replay, replay_json, shipped_traces
    from expertcache.serve.replay_child import replay_worker as _replay_worker
    from expertcache.trace.format import RoutingTrace

    name = next(iter(shipped_traces()))
    path, opts = parse_replay({"trace": name, "policy": "cache-prior", "lam": 0.5, "capacity": 6, "start": 7,
                               "steps": 40}, [])
    child = json.loads(_replay_worker.run(path, opts))
    here = json.loads(replay_json(RoutingTrace.load(path), opts))
    assert child == here and len(child["frames"]) == 40
    with registered_policy(TOY):
        path, opts = parse_replay({"trace": name, "policy": TOY.name, "steps": 8}, [])
        assert _replay_worker.run(path, opts) is None
