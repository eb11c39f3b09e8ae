"""The HTTP side: an OpenAI-compatible FastAPI app over an :class:`~expertcache.serve.engine.Engine`, wired from
small modules (this one only assembles them):

- :mod:`~expertcache.serve.errors`: :class:`ServeError` (every 4xx/5xx body is OpenAI's
  ``{"error": {"message", "type", "param", "code"}}``);
- :mod:`~expertcache.serve.schema`: request validation (every bad field a 400 naming it);
- :mod:`~expertcache.serve.guard`: the key, ``Host``, ``Origin``, ``Content-Type`` and body bounds, before any route;
- :mod:`~expertcache.serve.metrics`: Prometheus metrics;
- :mod:`~expertcache.serve.completions`: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
  ``/health``, ``/metrics``;
- :mod:`~expertcache.serve.liveview`: the live view's page and routes (optional).

The connection rules (header timeout, connection cap, head size) sit in the protocol: :mod:`expertcache.serve.server`.

Extensions: ``"ignore_eos": true`` decodes past the end-of-text token (fixed lengths for benchmarks);
``"expertcache": {"policy": "original"}`` routes that request's rows with original top-K inside the shared batch
(seed-reproducible output, see docs/SERVE.md).
"""

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from expertcache.serve.completions import install_completions
from expertcache.serve.defaults import (DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES,  # declared once (the CLI reads them)
                                        LOOPBACK_HOSTS)
from expertcache.serve.engine import Engine
from expertcache.serve.errors import RETRY_AFTER_503, ClientGone, ServeError, error_response
from expertcache.serve.guard import Guard, host_allowed, json_body, origin_allowed
from expertcache.serve.liveview import install_liveview
from expertcache.serve.metrics import Metrics
from expertcache.serve.schema import SHIPPED_CHAT_TEMPLATE, SUPPORTED_FIELDS, Validator, render_chat

__all__ = ["create_app", "begin_shutdown", "ServeError", "SHIPPED_CHAT_TEMPLATE", "render_chat", "Guard",
           "SUPPORTED_FIELDS", "DEFAULT_MAX_REQUEST_BYTES", "DEFAULT_BODY_TIMEOUT", "LOOPBACK_HOSTS", "host_allowed",
           "origin_allowed", "json_body", "ClientGone", "Metrics", "Validator", "RETRY_AFTER_503"]


def create_app(engine: Engine, model_id: str, *, tokenizer=None, aliases: tuple[str, ...] = (),
               metrics: Metrics | None = None, liveview: bool = True, trace_dirs: tuple = (),
               api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_prompt_tokens: int | None = None, allowed_hosts: tuple[str, ...] | None = None,
               body_timeout: float = DEFAULT_BODY_TIMEOUT):
    """FastAPI app serving ``engine`` under the model name ``model_id`` (``aliases`` are accepted too).
    ``liveview`` adds the page at ``/`` and its routes (:mod:`expertcache.serve.liveview`; ``trace_dirs``: more
    routing traces the replay may open). ``api_key``, ``max_request_bytes``, ``allowed_hosts`` (None: any Host),
    ``body_timeout``: the guard (:mod:`expertcache.serve.guard`); ``max_prompt_tokens`` (default: context - 1):
    the validator's bound. ``app.state.shutting_down`` (set by :func:`begin_shutdown`) makes new requests 503."""
    metrics = metrics or engine.metrics or Metrics()
    engine.metrics = metrics
    validator = Validator([model_id, *aliases], tokenizer, engine.context, int(engine.rt.config.vocab_size),
                          max_prompt_tokens)
    app = FastAPI(title="expertcache", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.shutting_down = False
    app.state.api_key_required = api_key is not None
    known_paths: set = set()

    def route_label(path: str) -> str:
        """The metrics label of a path: a route's own path, else one label for all others (a client must not
        grow the metrics, and the server's memory, by asking for ever new paths)."""
        if path in known_paths:
            return path
        return "/v1/models/{id}" if path.startswith("/v1/models/") else "(other)"

    def err(e: ServeError, request):
        return error_response(e, route_label(request.url.path), metrics)

    app.add_middleware(Guard, api_key=api_key, max_request_bytes=max_request_bytes, body_timeout=body_timeout,
                       query_key_paths=("/v1/expertcache/events",), allowed_hosts=allowed_hosts,
                       on_refused=lambda route, status: metrics.requests.labels(route_label(route), str(status)).inc())

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc):
        return err(ServeError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None),
                   request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        return err(ServeError(400, f"invalid request: {exc.errors()[:1]}"), request)

    @app.exception_handler(ServeError)
    async def _serve_error(request, exc):  # raised by the Guard's body reader or a route: its own status and body
        return err(exc, request)

    @app.exception_handler(Exception)
    async def _any(request, exc):  # pragma: no cover - a bug; still an OpenAI-style body
        return err(ServeError(500, f"internal error: {type(exc).__name__}: {exc}"), request)

    install_completions(app, engine, model_id, validator, metrics)
    if liveview:
        install_liveview(app, engine, trace_dirs=trace_dirs)
    known_paths.update(r.path for r in app.routes if "{" not in getattr(r, "path", "{"))
    return app


def begin_shutdown(app, grace_s: float) -> int:
    """New requests get 503; waiting ones are cancelled; running ones get ``grace_s`` to finish."""
    app.state.shutting_down = True
    for stop in getattr(app.state, "on_shutdown", ()):  # e.g. the replay child: nothing waits on it
        stop()
    return app.state.engine.begin_shutdown(grace_s)
