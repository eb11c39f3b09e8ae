"""The guard run before any route (:class:`Guard`, ASGI middleware): API key, ``Host``, ``Origin``,
``Content-Type``, and the request body's size and time bounds; :func:`json_body` reads a body it bounded.

``api_key`` requires ``Authorization: Bearer KEY`` on every ``/v1/*`` route (constant-time compare; the live view's
event stream may pass it as ``?api_key=``); every POST must be ``Content-Type: application/json`` (415) and, when a
browser sends ``Origin``, come from the origin the server is addressed as (``Host``; 403), so a page of another site
can neither steer nor use the server; with ``allowed_hosts`` (what ``expertcache serve`` sets when it listens on
loopback) every request's ``Host`` must name one of them (403), so a site whose DNS name is re-pointed at 127.0.0.1
(DNS rebinding: its pages then count as same-origin) reaches nothing; bodies over ``max_request_bytes`` get 413
before they are read. The connection rules (header timeout, connection cap) sit below, in
:mod:`expertcache.serve.server`'s protocol."""

import asyncio
import hmac
import ipaddress
import time
from urllib.parse import parse_qs, urlsplit

from starlette.responses import JSONResponse

from expertcache.serve.defaults import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES
from expertcache.serve.errors import ClientGone, ServeError
from expertcache.serve.schema import parse_json

__all__ = ["Guard", "origin_allowed", "host_allowed", "json_body"]


def _host_of(netloc: str, scheme: str) -> str:
    """``netloc`` lower-cased without the scheme's default port."""
    netloc = netloc.lower().strip()
    default = {"http": ":80", "https": ":443"}.get(scheme)
    return netloc[:-len(default)] if default and netloc.endswith(default) else netloc


def origin_allowed(origin: str | None, host: str | None, scheme: str = "http") -> bool:
    """A browser request's ``Origin`` is the origin the server is addressed as (``Host``). No Origin (a
    non-browser client, or a same-origin GET): allowed."""
    if origin is None:
        return True
    if not host or origin == "null":
        return False
    parts = urlsplit(origin)
    return bool(parts.netloc) and _host_of(parts.netloc, parts.scheme) == _host_of(host, scheme)


def host_allowed(host: str | None, allowed: tuple[str, ...] | None) -> bool:
    """Whether the ``Host`` header ``host`` (``name[:port]``, ``[v6][:port]``) names one of ``allowed``
    (None or ``"*"`` among them: any). ``localhost`` admits ``*.localhost`` too (RFC 6761: browsers resolve it
    to loopback themselves) and ``127.0.0.1`` the whole 127.0.0.0/8; a missing Host is refused."""
    if allowed is None or "*" in allowed:
        return True
    if not host:
        return False
    h = host.strip().lower()
    if h.startswith("["):
        name = h[1:h.find("]")] if "]" in h else h[1:]
    else:
        name = h.rsplit(":", 1)[0] if h.count(":") == 1 else h
    name = name.rstrip(".")
    names = {a.lower().strip("[]") for a in allowed}
    if name in names or ("localhost" in names and name.endswith(".localhost")):
        return True
    if "127.0.0.1" in names:
        try:
            return ipaddress.ip_address(name) in ipaddress.ip_network("127.0.0.0/8")
        except ValueError:
            return False
    return False


class Guard:
    """ASGI middleware run before any route: see the module docstring. Refusals are OpenAI error bodies."""

    def __init__(self, app, *, api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 query_key_paths: tuple[str, ...] = (), on_refused=None,
                 allowed_hosts: tuple[str, ...] | None = None, body_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        self.app, self.max_request_bytes, self.body_timeout = app, max_request_bytes, body_timeout
        self.allowed_hosts = None if allowed_hosts is None else tuple(allowed_hosts)
        self.api_key = None if api_key is None else api_key.encode()
        self.query_key_paths = set(query_key_paths)
        self.on_refused = on_refused

    def _key_ok(self, scope, headers: dict) -> bool:
        auth = headers.get(b"authorization", b"")
        given = auth[7:].strip() if auth[:7].lower() == b"bearer " else None
        if given is None and scope["path"] in self.query_key_paths:  # EventSource cannot send headers
            q = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
            given = q[0].encode("latin-1", "replace") if q else None
        return given is not None and hmac.compare_digest(given, self.api_key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope["headers"]:
            headers.setdefault(k.lower(), v)
        path = scope["path"]
        e = None
        host = headers.get(b"host", b"").decode("latin-1")
        if not host_allowed(host, self.allowed_hosts):
            e = ServeError(403, f"Host {host[:80]!r} is not a name this server answers to (it listens on loopback: "
                                "use localhost or 127.0.0.1, or start it with --allowed-host NAME)",
                           code="host_not_allowed")
        elif self.api_key is not None and (path == "/v1" or path.startswith("/v1/")) and scope["method"] != "OPTIONS" \
                and not self._key_ok(scope, headers):
            e = ServeError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' (the server's --api-key)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        elif scope["method"] == "POST":
            origin = headers.get(b"origin")
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            length = headers.get(b"content-length")
            if not origin_allowed(None if origin is None else origin.decode("latin-1"),
                                  headers.get(b"host", b"").decode("latin-1"), scope.get("scheme", "http")):
                e = ServeError(403, f"cross-origin request refused: Origin {origin.decode('latin-1')[:80]} is not "
                                    "this server", code="cross_origin")
            elif ctype != b"application/json":
                e = ServeError(415, f"Content-Type must be application/json, got {ctype.decode('latin-1')[:60]!r}",
                               code="unsupported_media_type")
            elif length is not None and (not length.isdigit() or int(length) > self.max_request_bytes):
                e = ServeError(413, f"the request body has {length.decode('latin-1')[:20]} bytes; this server takes "
                                    f"at most {self.max_request_bytes} (--max-request-bytes)",
                               code="request_too_large")
        if e is None:
            if scope["method"] in ("POST", "PUT", "PATCH"):
                receive = self._bounded(receive)
            return await self.app(scope, receive, send)
        if self.on_refused is not None:
            self.on_refused(path, e.status)
        await JSONResponse(e.body(), status_code=e.status, headers=e.headers)(scope, receive, send)


    def _bounded(self, receive):
        """``receive`` for a request with a body, counting its bytes as they arrive (chunked bodies have no
        Content-Length): past ``max_request_bytes`` it raises 413, past ``body_timeout`` seconds since the
        first read 408, and a client gone mid-body raises :class:`ClientGone` (499, logged quietly)."""
        limit, n, deadline = self.max_request_bytes, 0, None

        async def bounded():
            nonlocal n, deadline
            if deadline is None:
                deadline = time.monotonic() + self.body_timeout
            if deadline == float("inf"):
                return await receive()
            try:
                msg = await _within(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                raise ServeError(408, f"the request body did not arrive within {self.body_timeout:g} s "
                                      "(--body-timeout)", code="request_timeout") from None
            if msg["type"] == "http.disconnect":
                raise ClientGone()
            if msg["type"] == "http.request":
                n += len(msg.get("body", b""))
                if n > limit:
                    raise ServeError(413, f"the request body exceeds {limit} bytes (--max-request-bytes)",
                                     code="request_too_large")
                if not msg.get("more_body", False):
                    deadline = float("inf")  # read: later receives wait for a disconnect, untimed
            return msg

        return bounded



async def _within(awaitable, seconds: float):
    """``await awaitable`` within ``seconds`` (asyncio.TimeoutError): on Python 3.11+ without the task per call
    that ``wait_for`` makes (a trickled body is many messages)."""
    if not hasattr(asyncio, "timeout"):  # Python 3.10
        return await asyncio.wait_for(awaitable, max(0.0, seconds))
    async with asyncio.timeout(max(0.0, seconds)):
        return await awaitable


async def json_body(request, what: str = "the request body"):
    """The request's JSON body (bounded and timed by :class:`Guard`), parsed in a worker thread with
    :func:`expertcache.jsonsafe.loads` (nesting depth limited): 400 naming ``what`` if it is not JSON."""
    return await asyncio.to_thread(parse_json, await request.body(), what)

