"""The server's connection rules (serve/server.py's guarded protocol), counted on raw sockets:

- at the cap, every connection is held (none closed); a newcomer evicts nobody until its head arrives, then
  exactly one: the oldest connection still sending a body, else the oldest idle one; the newcomer is served;
- a body slower than the minimum rate after its grace gets 408 and is closed;
- a connection that sends no complete head within ``--header-timeout`` is closed; a request whose head arrived
  outlives the header timeout (its body may come later, its response is sent); after a response on a kept-alive
  connection the next head gets its own timeout.

Waits are bounded only against a hang (30 s); lower bounds (a sleep past the header timeout) are sleeps.

Surviving mutants of this file's own set: ``_evict`` without its ``oldest._waiting_for_head()`` check, and
``data_received`` without its ``idle.pop`` (each guards the other: a running connection is skipped by one or
the other; removing both is caught);
``_waiting_for_head`` without ``cycle.response_complete`` (h11's state is not IDLE while a request runs).
"""

from __future__ import annotations

import select
import socket
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from expertcache.offload import OffloadConfig, OffloadedModel  # noqa: E402
from expertcache.serve import Engine  # noqa: E402
from expertcache.serve.app import create_app  # noqa: E402
from expertcache.serve.server import ServerThread  # noqa: E402

CAP = 8  # connection_cap's floor: the smallest cap a server holds
HANG = 30.0
BODY = b'{"model": "granular", "prompt": [5, 6, 7], "max_tokens": 1}'


@pytest.fixture(scope="module")
def runtime():
    torch.set_num_threads(1)
    rt = OffloadedModel.from_pretrained("granular", OffloadConfig(io="cached", capacity=8))
    yield rt
    rt.close()


@pytest.fixture
def engine(runtime):
    """An engine per server: stopping a server shuts its engine down (as SIGTERM does)."""
    eng = Engine(runtime, None, max_batch=4, max_queue=16, rowwise_attention=False).start()
    yield eng
    eng.shutdown(0)


def _server(engine, **kw) -> ServerThread:  # kw: max_connections, header_timeout, body_grace_s, ...
    return ServerThread(create_app(engine, "granular", liveview=False), **kw).start()


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=HANG)
    time.sleep(0.05)  # accepted in this order (the protocol sees connections in accept order)
    return s


def _closed(s: socket.socket, wait: float = 0.0) -> bool:
    """Whether the server closed ``s`` (EOF or a reset within ``wait`` s); bytes still arriving (the rest of a
    response, a refusal) are read and skipped."""
    deadline = time.monotonic() + wait
    while True:
        r, _, _ = select.select([s], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            return False
        try:
            if s.recv(65536) == b"":
                return True
        except ConnectionResetError:
            return True


def _wait_closed(s: socket.socket) -> bool:
    return _closed(s, HANG)


def _head(n: int = len(BODY)) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % n)


def _response(s: socket.socket) -> bytes:
    s.settimeout(HANG)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _health(s: socket.socket) -> bytes:
    s.sendall(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
    return _response(s)


def test_at_the_cap_a_newcomer_whose_head_arrives_evicts_exactly_one_slow_client(engine):
    """Body senders go first, then the oldest idle connection; a newcomer that has sent nothing evicts nobody."""
    srv = _server(engine, max_connections=CAP, header_timeout=600.0, body_grace_s=600.0)
    socks = []
    try:
        port = srv.port
        sender = _connect(port)  # the oldest: its request's body is still arriving -- evicted first
        sender.sendall(_head())
        idle = [_connect(port) for _ in range(CAP - 1)]  # CAP held
        socks = [sender] + idle
        time.sleep(0.3)
        assert not any(_closed(s) for s in socks), "a connection below the cap was closed"
        new = _connect(port)  # one over the cap, no head yet: nobody is evicted for it
        socks.append(new)
        time.sleep(0.3)
        assert not any(_closed(s) for s in socks[:CAP]), "a newcomer without a head evicted a connection"
        assert _health(new).startswith(b"HTTP/1.1 200"), "the newcomer is served"
        assert _wait_closed(sender), "the body sender was not evicted first"
        time.sleep(0.3)
        assert [_closed(s) for s in idle] == [False] * (CAP - 1), "more than one connection was evicted"
        # the next newcomer evicts the oldest idle one (idle[0]); the held count stays at the cap
        newer = _connect(port)
        socks.append(newer)
        assert _health(newer).startswith(b"HTTP/1.1 200")
        assert _wait_closed(idle[0]), "the oldest idle connection was not evicted"
        time.sleep(0.3)
        assert [_closed(s) for s in idle[1:]] == [False] * (CAP - 2), "more than one connection was evicted"
        assert not _closed(new)
    finally:
        for s in socks:
            s.close()
        srv.stop()


def test_when_every_held_connection_sends_a_body_a_newcomer_evicts_the_oldest_sender(engine):
    """Trickling bodies hold no place against a request that has come (issue 43: half-sent bodies locked
    everyone out): the oldest body sender goes, the others keep theirs and complete."""
    srv = _server(engine, max_connections=CAP, header_timeout=600.0, body_grace_s=600.0)
    socks = []
    try:
        for _ in range(CAP):
            s = _connect(srv.port)
            s.sendall(_head())  # its body still arriving
            socks.append(s)
        time.sleep(0.3)
        extra = _connect(srv.port)
        socks.append(extra)
        assert _health(extra).startswith(b"HTTP/1.1 200"), "the newcomer was refused"
        assert _wait_closed(socks[0]), "the oldest body sender was not evicted"
        time.sleep(0.3)
        assert [_closed(s) for s in socks[1:CAP]] == [False] * (CAP - 1), "more than one sender was evicted"
        for s in socks[1:CAP]:
            s.sendall(BODY)
        assert all(_response(s).startswith(b"HTTP/1.1 200") for s in socks[1:CAP])
    finally:
        for s in socks:
            s.close()
        srv.stop()


def test_a_kept_alive_connection_after_its_response_is_idle_again_and_evictable(engine):
    srv = _server(engine, max_connections=CAP, header_timeout=600.0)
    socks = []
    try:
        kept = _connect(srv.port)
        assert _health(kept).startswith(b"HTTP/1.1 200")  # its response done: it waits for a next head
        socks = [kept] + [_connect(srv.port) for _ in range(CAP - 1)]  # younger idle connections
        time.sleep(0.3)
        new = _connect(srv.port)
        socks.append(new)
        assert _health(new).startswith(b"HTTP/1.1 200"), "the newcomer was refused instead"
        assert _wait_closed(kept), "the kept-alive idle connection was not evicted"
        time.sleep(0.3)
        assert [_closed(s) for s in socks[1:CAP]] == [False] * (CAP - 1)
    finally:
        for s in socks:
            s.close()
        srv.stop()


def test_a_trickling_body_is_cut_with_408_after_its_grace(engine):
    srv = _server(engine, max_connections=64, header_timeout=600.0, body_grace_s=0.5, min_body_rate=2048)
    s = _connect(srv.port)
    try:
        s.sendall(_head(100_000))
        s.sendall(b"{")  # one byte: far below 2 KiB/s
        got = _response(s)
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert _wait_closed(s)
    finally:
        s.close()
        srv.stop()


HEADER_TIMEOUT = 1.0


def test_header_timeout_closes_a_slow_head_and_a_running_request_outlives_it(engine):
    srv = _server(engine, max_connections=64, header_timeout=HEADER_TIMEOUT, body_grace_s=600.0)
    socks = []
    try:
        slow = _connect(srv.port)
        slow.sendall(b"GET /health HTTP/1.1\r\nhost: loc")  # half a head
        running = _connect(srv.port)
        running.sendall(_head())  # a whole head: a request runs
        socks = [slow, running]
        assert _wait_closed(slow), "a half-sent head was not closed"
        time.sleep(3 * HEADER_TIMEOUT)  # well past the header timeout
        assert not _closed(running), "a running request was closed by the header timeout"
        running.sendall(BODY)
        assert _response(running).startswith(b"HTTP/1.1 200")
        # kept alive: the next head gets its own header timeout, counted from the end of that response (uvicorn's
        # keep-alive timeout is 5 s: closed within HANG either way; the eviction test pins the re-arming)
        assert _wait_closed(running), "an idle kept-alive connection was never closed"
    finally:
        for s in socks:
            s.close()
        srv.stop()


class _BodyLog:
    """A bare ASGI app: each request's body messages (their sizes), answered with the body's length and SHA-256
    and how many messages carried it."""

    def __init__(self) -> None:
        self.messages: list[list[int]] = []

    async def __call__(self, scope, receive, send) -> None:
        import hashlib
        import json

        if scope["type"] != "http":
            return
        sizes, body = [], b""
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            sizes.append(len(msg.get("body", b"")))
            body += msg.get("body", b"")
            if not msg.get("more_body", False):
                break
        self.messages.append(sizes)
        out = json.dumps({"bytes": len(body), "sha": hashlib.sha256(body).hexdigest(), "messages": len(sizes)})
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json"),
                                                                       (b"content-length", b"%d" % len(out))]})
        await send({"type": "http.response.body", "body": out.encode()})


@pytest.fixture
def bare():
    """uvicorn with the guarded protocol over :class:`_BodyLog` on an ephemeral loopback port (no model)."""
    import threading

    import uvicorn

    from expertcache.serve.server import bind, guarded_protocol

    app = _BodyLog()
    sock = bind()
    server = uvicorn.Server(uvicorn.Config(app, http=guarded_protocol(64, 600.0, body_grace_s=600.0),
                                           lifespan="off", log_level="error"))
    t = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    t.start()
    t0 = time.monotonic()
    while not server.started:
        assert time.monotonic() - t0 < HANG and t.is_alive(), "the bare server did not start"
        time.sleep(0.02)
    yield app, sock.getsockname()[1]
    server.should_exit = True
    t.join(HANG)
    sock.close()


def _answer(f) -> dict:
    """The next response on ``f`` (the socket's ``makefile("rb")``: bytes of a later response stay buffered):
    200, its JSON body."""
    import json

    status = f.readline()
    assert status.startswith(b"HTTP/1.1 200"), status
    length = None
    while True:
        line = f.readline()
        assert line, "closed mid-head"
        if line in (b"\r\n", b"\n"):
            break
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = f.read(length)
    assert len(body) == length, body
    return json.loads(body)


def test_a_body_trickled_a_byte_at_a_time_reaches_the_app_whole_in_one_message(bare):
    """The app's task wakes once for a trickled Content-Length body, not once per byte (issue 43: 1,100 tricklers'
    per-byte wake-ups stalled the loop); the bytes are exactly those sent."""
    import hashlib

    app, port = bare
    body = bytes(range(32, 72))
    s = socket.create_connection(("127.0.0.1", port), timeout=HANG)
    try:
        s.sendall(b"POST /x HTTP/1.1\r\nhost: localhost\r\ncontent-length: %d\r\n\r\n" % len(body))
        for i in range(len(body)):
            time.sleep(0.01)
            s.sendall(body[i:i + 1])
        got = _answer(s.makefile("rb"))
    finally:
        s.close()
    assert got == {"bytes": len(body), "sha": hashlib.sha256(body).hexdigest(), "messages": 1}


def test_held_bodies_keep_their_bytes_across_pipelining_large_bodies_and_chunked_ones(bare):
    """The end of a held body and the next request in one read are both served; a body larger than HOLD_BYTES
    comes whole (in more than one message); a chunked body passes through as it comes."""
    import hashlib

    from expertcache.serve import server as server_mod

    HOLD_BYTES = getattr(server_mod, "HOLD_BYTES", 64 * 1024)  # (getattr: a guard that holds on older trees too)
    app, port = bare
    s = socket.create_connection(("127.0.0.1", port), timeout=HANG)
    f = s.makefile("rb")
    try:
        a, b = b"first body", b"second"
        s.sendall(b"POST /x HTTP/1.1\r\nhost: localhost\r\ncontent-length: %d\r\n\r\n" % len(a) + a[:3])
        time.sleep(0.1)
        s.sendall(a[3:] + b"POST /y HTTP/1.1\r\nhost: localhost\r\ncontent-length: %d\r\n\r\n" % len(b) + b)
        def whole(data: bytes) -> dict:
            got = _answer(f)
            assert (got["bytes"], got["sha"]) == (len(data), hashlib.sha256(data).hexdigest())
            return got

        whole(a)
        whole(b)
        big = bytes(i % 251 for i in range(3 * HOLD_BYTES + 17))
        s.sendall(b"POST /z HTTP/1.1\r\nhost: localhost\r\ncontent-length: %d\r\n\r\n" % len(big))
        for i in range(0, len(big), 4096):
            s.sendall(big[i:i + 4096])
        assert whole(big)["messages"] >= 2
        s.sendall(b"POST /c HTTP/1.1\r\nhost: localhost\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        time.sleep(0.2)
        s.sendall(b"2\r\nde\r\n0\r\n\r\n")
        assert whole(b"abcde")["messages"] >= 2  # "abc" reached the app before the rest was sent
    finally:
        f.close()
        s.close()
