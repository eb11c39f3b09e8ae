"""Running the app: uvicorn with a graceful SIGTERM/SIGINT (:func:`serve_forever`), or in a thread on an
ephemeral loopback port (:class:`ServerThread`, for tests and benchmarks)."""

from __future__ import annotations

import collections
import gc
import http
import json
import logging
import re
import socket
import sys
import threading
import time

from expertcache.serve.defaults import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS

__all__ = ["serve_forever", "ServerThread", "bind", "tune_malloc", "freeze_heap", "guarded_protocol", "connection_cap",
           "fd_limit", "DEFAULT_HEADER_TIMEOUT", "DEFAULT_MAX_CONNECTIONS", "MAX_HEAD_BYTES", "MAX_HEADERS",
           "MIN_BODY_RATE", "HOLD_BYTES", "head_limited_connection", "refusal"]

#: the listening socket's accept queue (connections the kernel holds before the server accepts them)
BACKLOG = 2048
#: connections asyncio accepts in one go before the protocols (and the connection cap) see them: it accepts up
#: to its ``backlog`` argument at once, so this is passed there and the listen queue is set back to BACKLOG
ACCEPT_BATCH = 32


def tune_malloc(threshold: int = 1 << 16) -> bool:
    """glibc only: serve allocations of ``threshold`` bytes or more from mmap (``M_MMAP_THRESHOLD``), so the
    KV tensors a server keeps re-allocating (rows join and leave, every decode step grows the cache by
    ``torch.cat``) go back to the OS when freed instead of staying in the heap once glibc's dynamic threshold
    has risen. Measured in-process on the granular model (16 rows × 32 tokens per round): RSS 526 → 541 MiB
    then flat with it, 543 → 561 MiB and still rising without. The HTTP server's RSS still grows, sub-linearly
    (BENCHMARKS.md, serving section). True if applied."""
    from expertcache.offload.budget import glibc

    libc = glibc()
    return bool(libc is not None and libc.mallopt(-3, int(threshold)))  # M_MMAP_THRESHOLD = -3


def freeze_heap() -> int:
    """Move every object alive now (the loaded model, tokenizer, libraries: about 515,000 on the granular model)
    out of the garbage collector's reach (``gc.freeze``), after one last collection. Called once the app is built:
    Python's full (generation-2) collection walks every tracked object while holding the GIL, and a flood of
    connections (each holds ~170 tracked objects while it lives) triggered one every 1-2 s, each 0.25-0.7 s long
    with the whole startup heap in it: the event loop and the engine thread both stood still, the running stream's
    largest gaps under 1,100 trickling bodies were exactly those collections (now 14-86 ms of CPU each: the
    connections' objects only). Objects made later are collected as usual. Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket (port 0 = an ephemeral port; read it from ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


#: the interpreter's thread switch interval in a server process (Python's default: 5 ms). The engine thread
#: releases the GIL in every torch op and waits up to this long to get it back from a busy event loop: under
#: 1,100 trickling bodies a stream's largest gap was 1.28 s at 5 ms, 0.66 s at 0.5 ms (median of 2, load 10)
SWITCH_INTERVAL_S = 0.0005
#: file descriptors kept for everything but client connections (model files, logs, threads' pipes, the listener)
FD_RESERVE = 64
#: the largest request head (request line and headers) taken, however its bytes arrive: larger gets 431
MAX_HEAD_BYTES = 16 * 1024
#: the most header lines a request head may have: more gets 431 (a browser sends about 20)
MAX_HEADERS = 100
#: a request body must arrive at this many bytes per second on average, counted after BODY_GRACE_S seconds
#: (a 1 MiB body: 8 minutes; a trickle of a byte a second is cut after about 2 s; then 408 and close)
MIN_BODY_RATE = 2048
BODY_GRACE_S = 2.0
#: how often a body's rate is checked
BODY_CHECK_S = 0.5
#: a Content-Length body's bytes are held by the connection until the body is complete or this many are held,
#: then handed to the app at once (uvicorn's own buffer pauses reading at 64 KiB): a body trickled a byte at a
#: time no longer wakes the app's task (and parses with h11) once per byte. Under 1,100 trickling bodies those
#: wake-ups were a loop iteration of 30-330 ms every 0.5 s, and the running stream waited behind it
HOLD_BYTES = 64 * 1024
_REFUSAL = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n%sconnection: close\r\ncontent-length: %d\r\n\r\n%s")
_BLANK_LINE = re.compile(rb"\n\r?\n")
_NOT_CRLF = re.compile(rb"[^\r\n]")


def refusal(status: int, message: str, code: str, extra_headers: bytes = b"") -> bytes:
    """A whole HTTP/1.1 response that closes the connection, with OpenAI's error body."""
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500 else
                                 "invalid_request_error", "param": None, "code": code}}).encode()
    reason = http.HTTPStatus(status).phrase.encode()
    return _REFUSAL % (status, reason, extra_headers, len(body), body)


def fd_limit(raise_soft: bool = True) -> int:
    """The process's file-descriptor limit (RLIMIT_NOFILE), first raised to the hard limit when ``raise_soft``
    (as servers do at start: the soft limit is often 1,024). Unknown (not POSIX): a large number."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return 1 << 20
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if raise_soft and soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def open_fds() -> int:
    """File descriptors this process holds now (0 where /proc is not there)."""
    import os

    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_cap(max_connections: int = DEFAULT_MAX_CONNECTIONS, fds: int | None = None) -> int:
    """Client connections held at once: ``max_connections``, and below the file-descriptor limit ``fds`` less
    the descriptors already open, ``FD_RESERVE`` more for later (files, pipes) and the sockets accepted but not
    yet seen by the protocol, so accepting never fails with EMFILE. Call it once the model is loaded."""
    fds = fd_limit() if fds is None else fds
    # accepted sockets reach the protocol (and evictions close) a loop iteration or two later: room for 4 batches
    return max(8, min(max_connections, fds - open_fds() - FD_RESERVE - 4 * ACCEPT_BATCH))


def head_limited_connection():
    """An ``h11.Connection`` whose request heads are bounded on the bytes, however they arrive: h11's own limit
    (``max_incomplete_event_size``) applies only while a head is incomplete, so a head of 10,000 headers sent
    in one read was parsed (0.8 s of server time each). Before h11 parses a head, its bytes are scanned (each
    byte once, in C): over :data:`MAX_HEAD_BYTES` or :data:`MAX_HEADERS` lines is refused (431); a request with
    both Content-Length and Transfer-Encoding is refused (400; RFC 9112 section 6.1: a proxy that frames by
    Content-Length would see another request in its body). ``refusal`` holds (status, message, code)."""
    import h11

    class HeadLimitedConnection(h11.Connection):
        refusal: tuple | None = None
        _scanned = 0  # buffer bytes already searched for the head's end (each byte is searched once)

        def _refuse(self, status: int, message: str, code: str):
            self.refusal = (status, message, code)
            return h11.RemoteProtocolError(message, error_status_hint=status)

        def _check_head(self) -> None:
            rb = self._receive_buffer
            buf = getattr(rb, "_data", None)
            if buf is None:  # pragma: no cover - another h11 layout: look at the head's first bytes
                buf = bytes(rb)[:MAX_HEAD_BYTES + 8]
            n = len(buf)
            if n < self._scanned:
                self._scanned = 0
            first = _NOT_CRLF.search(buf, 0, MAX_HEAD_BYTES + 1)  # h11 skips blank lines before a request line
            start = first.start() if first is not None else n
            end = _BLANK_LINE.search(buf, max(start, self._scanned - 2), start + MAX_HEAD_BYTES + 2)
            if end is None:
                self._scanned = n
                if n - start > MAX_HEAD_BYTES or start > MAX_HEAD_BYTES:
                    raise self._refuse(431, f"the request head exceeds {MAX_HEAD_BYTES} bytes",
                                       "request_header_fields_too_large")
                return
            if end.end() - start > MAX_HEAD_BYTES:
                raise self._refuse(431, f"the request head exceeds {MAX_HEAD_BYTES} bytes",
                                   "request_header_fields_too_large")
            lines = buf.count(b"\n", start, end.end()) - 2  # less the request line and the blank line
            if lines > MAX_HEADERS:
                raise self._refuse(431, f"the request has {lines} header lines; this server takes at most "
                                        f"{MAX_HEADERS}", "request_header_fields_too_large")

        def next_event(self):
            if self.their_state is h11.IDLE:
                self._check_head()
            event = super().next_event()
            if type(event) is h11.Request:
                self._scanned = 0
                names = {k.lower() for k, _ in event.headers}
                if b"transfer-encoding" in names and b"content-length" in names:
                    raise self._refuse(400, "a request may not carry both Content-Length and Transfer-Encoding",
                                       "ambiguous_framing")
            return event

    return HeadLimitedConnection


def guarded_protocol(max_connections: int, header_timeout: float = DEFAULT_HEADER_TIMEOUT, *,
                     min_body_rate: float = MIN_BODY_RATE, body_grace_s: float = BODY_GRACE_S):
    """uvicorn's h11 protocol with what it lacks against slow, numerous and malformed clients:

    - a **header timeout**: a connection that has not sent a whole request head within ``header_timeout``
      seconds of its start (or of its previous response) is closed, so half-sent requests cannot pile up;
    - a **body rate**: a request body must arrive at ``min_body_rate`` bytes/s on average after
      ``body_grace_s`` seconds (a trickle is cut: 408 and close), so half-sent bodies cannot pile up either;
    - **bodies handed over whole**: a Content-Length body's bytes reach the app when the body is complete or
      :data:`HOLD_BYTES` have arrived, not per read (the rate, size and time bounds see every byte as it arrives);
    - a **connection cap**: at ``max_connections`` open connections a new one first evicts the oldest that is
      idle, still sending its head or still sending its body (no request computing: nothing is lost but a slow
      client's place); if every connection runs a request, the new one gets a 503 with Retry-After and is
      closed at once;
    - **head limits on the bytes** and no ambiguous framing (:func:`head_limited_connection`): 431 / 400, then
      close.

    Body size and the body's total time are bounded by the app (:class:`expertcache.serve.guard.Guard`)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    too_many = refusal(503, "too many connections; retry later", "too_many_connections", b"retry-after: 1\r\n")
    too_slow = refusal(408, f"the request body arrived slower than {min_body_rate:g} bytes/s", "request_timeout")
    Connection = head_limited_connection()

    # connections computing no request, oldest first: those sending a body (evicted first: a client that
    # connected a moment ago has not had its head read yet, and must not lose its place to a trickle), and
    # those idle or sending a head
    bodies: collections.OrderedDict = collections.OrderedDict()
    heads: collections.OrderedDict = collections.OrderedDict()

    class GuardedH11Protocol(H11Protocol):
        _refused = False
        _head_timer = None
        _body_timer = None
        _body_t0 = 0.0
        _body_bytes = 0
        _held = None  # a Content-Length body's bytes not yet given to h11 (bytearray), while _body_left > 0
        _body_left = 0  # that body's bytes not yet given to h11

        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            self.conn = Connection(h11.SERVER, MAX_HEAD_BYTES)

        def _waiting_for_head(self) -> bool:
            return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

        def _sending_body(self) -> bool:
            return self.conn.their_state is h11.SEND_BODY

        def connection_made(self, transport) -> None:
            # up to max_connections + ACCEPT_BATCH are taken (connection_cap leaves the file descriptors): a
            # connection over max_connections makes room when its head has arrived (data_received), so a client
            # that sends its request at once is never the one evicted by a flood of newer connections
            if len(self.connections) >= max_connections + ACCEPT_BATCH and not self._evict():
                self._refused = True
                self.transport = transport
                transport.write(too_many)
                transport.close()
                return
            super().connection_made(transport)
            self._arm()

        @staticmethod
        def _evict(keep=None) -> bool:
            """Close the oldest connection sending a body, else the oldest idle or sending its head (never
            ``keep``); False if every connection computes a request."""
            for queue in (bodies, heads):
                kept = False
                while queue:
                    oldest, _ = queue.popitem(last=False)
                    if oldest is keep:
                        kept = True
                    elif (oldest._waiting_for_head() or oldest._sending_body()) and not oldest.transport.is_closing():
                        oldest.connections.discard(oldest)
                        oldest.transport.close()
                        if kept:
                            queue[keep] = None
                        return True
                if kept:
                    queue[keep] = None
            return False

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(header_timeout, self._head_timeout)
            bodies.pop(self, None)
            heads[self] = None
            heads.move_to_end(self)

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.close()

        def _check_body(self) -> None:
            """Every BODY_CHECK_S while a body arrives: cut it (408, close) below ``min_body_rate``."""
            self._body_timer = None
            if not self._sending_body() or self.transport.is_closing():
                return
            late = time.monotonic() - self._body_t0 - body_grace_s
            if late > 0 and self._body_bytes < min_body_rate * late and not self.flow.read_paused:
                if self.cycle is not None and not self.cycle.response_started:
                    self.transport.write(too_slow)
                self.transport.close()
                return
            self._body_timer = self.loop.call_later(BODY_CHECK_S, self._check_body)

        def _hold(self, data: bytes) -> bytes | None:
            """Keep ``data`` of a Content-Length body back; the bytes held once the body is complete (with
            anything after it: a pipelined request) or HOLD_BYTES are held, else None."""
            held = self._held
            held += data
            if len(held) < self._body_left and len(held) < HOLD_BYTES:
                return None
            self._body_left = max(0, self._body_left - len(held))
            self._held = bytearray()
            return bytes(held)

        def _start_holding(self) -> None:
            """A head just arrived and its body follows: hold it if it has a Content-Length (a chunked body and a
            client waiting for 100 Continue pass through as they come)."""
            self._body_left, self._held = 0, None
            length = next((v for k, v in self.headers if k == b"content-length"), None)
            if (length is None or not length.isdigit() or self.conn.they_are_waiting_for_100_continue
                    or self.cycle is None):  # (no cycle: a websocket upgrade took the connection)
                return
            self._body_left = int(length) - len(self.cycle.body)  # the part that came with the head is in there
            if self._body_left > 0:
                self._held = bytearray()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._body_left > 0 and self._sending_body():
                self._unset_keepalive_if_required()  # as uvicorn does for every read
                self._body_bytes += len(data)
                data = self._hold(data)
                if data is None:
                    return
                counted = True
            else:
                counted = False
            in_body, in_head = self._sending_body(), self._waiting_for_head()
            super().data_received(data)
            if in_head and not self._waiting_for_head() and len(self.connections) > max_connections:
                self._evict(keep=self)  # a request has come: room for it at a slow client's expense
            if self._sending_body():
                if in_body:
                    if not counted:
                        self._body_bytes += len(data)
                else:  # a head just arrived, its body follows: time it
                    heads.pop(self, None)
                    bodies[self] = None
                    self._body_t0, self._body_bytes = time.monotonic(), 0
                    self._start_holding()
                    if self._body_timer is None:
                        self._body_timer = self.loop.call_later(BODY_CHECK_S, self._check_body)
            elif not self._waiting_for_head():  # a request computes: not evictable until its response is done
                heads.pop(self, None)
                bodies.pop(self, None)

        def send_400_response(self, msg: str) -> None:
            status, message, code = self.conn.refusal or (400, "invalid HTTP request", "invalid_request")
            self.transport.write(refusal(status, message, code))
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head gets its own header_timeout

        def connection_lost(self, exc) -> None:
            heads.pop(self, None)
            bodies.pop(self, None)
            for t in (self._head_timer, self._body_timer):
                if t is not None:
                    t.cancel()
            self._head_timer = self._body_timer = None
            if self._refused:
                return
            super().connection_lost(exc)

    return GuardedH11Protocol


class _Once(logging.Filter):
    """Lets a log message through at most once per ``every`` seconds (then says how many were left out): a
    flood of one message (refused accepts, invalid requests, one failing route) cannot fill the disk."""

    def __init__(self, every: float = 10.0) -> None:
        super().__init__()
        self.every = every
        self._last: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg)[:200]
        now = time.monotonic()
        t, n = self._last.get(key, (-1e9, 0))
        if now - t < self.every:
            self._last[key] = (t, n + 1)
            return False
        if len(self._last) > 1000:
            self._last.clear()
        self._last[key] = (now, 0)
        if n:
            record.msg = f"{record.msg} ({n} more like this in the last {now - t:.0f} s not logged)"
        return True  # with its traceback, if any: at most one per message per ``every`` seconds


def quiet_floods() -> None:
    """Rate-limit uvicorn's and asyncio's per-connection messages (see :class:`_Once`); idempotent."""
    for name in ("uvicorn.error", "asyncio"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, _Once) for f in lg.filters):
            lg.addFilter(_Once())


def _server(app, *, log_level: str, grace_s: float, max_connections: int = DEFAULT_MAX_CONNECTIONS,
            header_timeout: float = DEFAULT_HEADER_TIMEOUT, min_body_rate: float = MIN_BODY_RATE,
            body_grace_s: float = BODY_GRACE_S):
    """A uvicorn server for ``app`` that shuts down gracefully: on the first SIGTERM/SIGINT new requests get
    503 (the server keeps accepting connections to say so), waiting ones are cancelled, running ones get
    ``grace_s`` to finish (then are cancelled); once none is left uvicorn stops listening, waits for their
    connections, then returns normally (the signal is handled, not re-raised). A second signal stops at once."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            for sock in sockets or ():  # asyncio's listen(ACCEPT_BATCH) above: the kernel's queue back to BACKLOG
                sock.listen(BACKLOG)

        def handle_exit(self, sig, frame) -> None:
            from expertcache.serve.app import begin_shutdown

            if app.state.shutting_down:  # the second signal: stop listening now
                super().handle_exit(sig, frame)
                self._captured_signals.clear()
                return
            n = begin_shutdown(app, grace_s)
            print(f"expertcache serve: shutting down: {app.state.engine.in_flight()} running request(s) get up "
                  f"to {grace_s:g} s to finish, {n} waiting request(s) cancelled (503)", file=sys.stderr,
                  flush=True)
            self._captured_signals.clear()
            threading.Thread(target=self._drain_then_exit, args=(sig, frame), daemon=True,
                             name="expertcache-drain").start()

        def _drain_then_exit(self, sig, frame) -> None:
            """Keep answering (503 for new requests) until the engine has nothing in flight, then let uvicorn
            stop (the engine cancels what is left after ``grace_s``; one more second for their last events)."""
            eng = app.state.engine
            deadline = time.monotonic() + grace_s + 1.0
            while (eng.in_flight() or eng.queue_length()) and time.monotonic() < deadline:
                time.sleep(0.02)
            uvicorn.Server.handle_exit(self, sig, frame)
            self._captured_signals.clear()

    cap = connection_cap(max_connections)
    quiet_floods()
    return Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace_s + 5, lifespan="off",
                                 access_log=False, timeout_keep_alive=5,
                                 http=guarded_protocol(cap, header_timeout, min_body_rate=min_body_rate,
                                                       body_grace_s=body_grace_s),
                                 limit_concurrency=2 * cap + 64,  # a backstop: the cap rules
                                 h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                                 backlog=ACCEPT_BATCH))


def serve_forever(app, sock: socket.socket, *, grace_s: float = 30.0, log_level: str = "warning",
                  max_connections: int = DEFAULT_MAX_CONNECTIONS,
                  header_timeout: float = DEFAULT_HEADER_TIMEOUT) -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    server = _server(app, log_level=log_level, grace_s=grace_s, max_connections=max_connections,
                     header_timeout=header_timeout)
    freeze_heap()  # the last thing before serving: a full collection no longer walks the startup heap
    server.run(sockets=[sock])


class ServerThread:
    """uvicorn in a daemon thread on ``127.0.0.1:<ephemeral>``; :meth:`stop` shuts it down like SIGTERM."""

    def __init__(self, app, *, grace_s: float = 5.0, host: str = "127.0.0.1", **kw) -> None:
        self.app = app
        self.sock = bind(host, 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = _server(app, log_level="error", grace_s=grace_s, **kw)
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]), daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if time.monotonic() - t0 > timeout or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.handle_exit(15, None)
        self.thread.join(timeout)
        self.sock.close()
