"""The live view of the expert cache (issue 16): a page at ``/``, its event stream, live controls and trace replay.

Routes added to the serve app by :func:`install_liveview` (schema in ``docs/SERVE.md``, "Live view"):

- ``GET /`` and ``GET /static/<file>``: the page (plain HTML/JS/CSS shipped in ``serve/static``, no build step,
  nothing fetched from elsewhere);
- ``GET /v1/expertcache/events``: server-sent events, one JSON frame per model forward (per MoE layer: the
  experts requested, hits, misses, evictions, prefetches and the resident set after the step; running totals).
  Each subscriber has a bounded queue (:mod:`~expertcache.serve.broker`): when a page reads slower than the model
  decodes, its oldest frames are dropped (and counted), the engine thread never waits;
- ``GET /v1/expertcache/config``, ``POST /v1/expertcache/config``: the resolved routing policy, eviction and
  cache size the runtime really uses; a POST validates (400 with an OpenAI error body naming the field) and the
  engine thread applies it between two forwards (:mod:`~expertcache.serve.control`);
- ``GET /v1/expertcache/traces``, ``POST /v1/expertcache/replay``: step through a routing trace (the shipped ones
  or ``--trace-dir``'s) under any policy, eviction and cache size with the simulator
  (:mod:`~expertcache.serve.replay`, run in :mod:`~expertcache.serve.replay_child`'s process); per-step frames in
  the same schema as the live ones.

The frames come from :class:`~expertcache.serve.tap.Tap`, which only observes the runtime.
"""

import asyncio
import json
import time
from pathlib import Path

from fastapi import Request as HTTPRequest
from fastapi.responses import FileResponse, JSONResponse
from starlette.responses import Response

from expertcache.serve.broker import MAX_SUBSCRIBERS, Broker, sorted_ids
from expertcache.serve.control import ConfigError, LiveControl
from expertcache.serve.errors import ClientGone, ServeError
from expertcache.serve.guard import json_body as read_json
from expertcache.serve.replay import (list_traces, load_regular_trace, parse_replay, public_message,  # noqa: F401
                                      replay_frames, replay_json, shipped_traces)
from expertcache.serve.replay_child import ReplayWorker
from expertcache.serve.stream import TimedStream
from expertcache.serve.tap import Tap
from expertcache.trace.format import RoutingTrace, TraceError

__all__ = ["install_liveview", "Broker", "Tap", "LiveControl", "TimedStream", "replay_frames", "SCHEMA_VERSION",
           "shipped_traces", "list_traces", "parse_replay", "STATIC", "MAX_SUBSCRIBERS"]

SCHEMA_VERSION = 1
STATIC = Path(__file__).with_name("static")
#: replays waiting for the one that runs (more get 429); one runs at a time, built and serialised off the loop
MAX_REPLAYS_WAITING = 4


def install_liveview(app, engine, *, trace_dirs=(), queue_frames: int = 64) -> None:
    """Add the page, the event stream, the live controls and the replay to the serve ``app``."""
    broker = Broker(queue_frames)
    control = LiveControl(engine, broker)
    tap = Tap(engine, broker, control)
    control.tap = tap
    app.state.liveview = dict(broker=broker, control=control, tap=tap)
    trace_dirs = [Path(d) for d in trace_dirs]
    trace_cache: dict[Path, RoutingTrace] = {}
    files = {p.name: p for p in STATIC.iterdir() if p.is_file()}
    types = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
             ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}

    # the server's folders a message could name (a trace's, the package's): written as names only
    private = [*trace_dirs, STATIC.parent.parent, *shipped_traces().values()]

    def bad(e: ConfigError, path: Path | None = None) -> JSONResponse:
        msg = public_message(str(e), private + ([path] if path is not None else []))
        return JSONResponse(ServeError(400, msg, param=e.param, code="invalid_value").body(), status_code=400)

    async def json_body(request: HTTPRequest):
        try:
            return await read_json(request, "the request body")
        except ServeError as e:
            if e.status != 400:
                raise  # 413 / 408 / 499 from the Guard's body reader: the app's handler answers
            raise ConfigError("body", e.message) from None

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(files["index.html"], media_type=types[".html"], headers={"Cache-Control": "no-cache"})

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        p = files.get(name)  # only the shipped files, by exact name
        if p is None:
            return JSONResponse(ServeError(404, f"no static file {name!r}", code="not_found").body(), status_code=404)
        return FileResponse(p, media_type=types.get(p.suffix, "application/octet-stream"),
                            headers={"Cache-Control": "no-cache"})

    @app.get("/v1/expertcache/config")
    async def get_config():
        return control.resolved()

    @app.post("/v1/expertcache/config")
    async def post_config(request: HTTPRequest):
        try:
            return await control.request_async(await json_body(request))
        except ConfigError as e:
            return bad(e)

    @app.get("/v1/expertcache/stats")
    async def stats():
        return dict(totals=tap.totals, published=broker.published,
                    subscribers=[dict(queued=len(s.frames), dropped=s.dropped, delivered=s.delivered)
                                 for s in broker.subscribers])

    @app.get("/v1/expertcache/events")
    async def events(request: HTTPRequest):
        sub = broker.subscribe(asyncio.get_running_loop())
        if sub is None:
            raise ServeError(429, f"{broker.max_subscribers} live-view pages are subscribed already; close one or "
                                  "retry later", code="too_many_subscribers", headers={"Retry-After": "5"})
        rt = engine.rt
        for _ in range(100):  # the engine thread may be changing a cache right now: read again
            try:
                layers = [dict(resident=sorted_ids(st.cache.resident())) for st in rt.states]
                break
            except RuntimeError:
                await asyncio.sleep(0.001)
        else:
            layers = [dict(resident=[]) for _ in rt.states]
        hello = dict(type="hello", schema_version=SCHEMA_VERSION, config=control.resolved(), queue_frames=broker.maxlen,
                     layers=layers, totals=dict(tap.totals))

        async def stream():
            try:
                yield f"data: {json.dumps(hello)}\n\n"
                last = time.monotonic()
                while not app.state.shutting_down and not sub.stalled and not sub.closed:
                    try:
                        await asyncio.wait_for(sub.ready.wait(), timeout=0.25)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():
                            return
                        if time.monotonic() - last > 15:
                            last = time.monotonic()
                            yield ": keep-alive\n\n"
                        continue
                    frames = sub.take()
                    if frames:
                        dropped = sub.dropped
                        last = time.monotonic()
                        yield "".join(f"data: {json.dumps(dict(f, dropped=dropped))}\n\n" for f in frames)
            finally:
                broker.unsubscribe(sub)

        return TimedStream(stream(), sub)

    @app.get("/v1/expertcache/traces")
    async def traces():
        return dict(traces=[dict(name=n, shipped=n in shipped_traces()) for n in list_traces(trace_dirs)])

    worker = ReplayWorker()
    replays = dict(lock=asyncio.Lock(), waiting=0, worker=worker)
    app.state.liveview["replays"] = replays
    app.state.on_shutdown = [*getattr(app.state, "on_shutdown", ()), worker.shutdown]  # no wait on a hung child

    async def client_left(request: HTTPRequest) -> None:
        """Returns when the client of ``request`` (whose body was read) closes its connection."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def acquire_unless_gone(request: HTTPRequest) -> bool:
        """Take the replay lock, or give up when the client leaves first (False)."""
        acquire = asyncio.ensure_future(replays["lock"].acquire())
        gone = asyncio.ensure_future(client_left(request))
        try:
            await asyncio.wait({acquire, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not acquire.done():
                acquire.cancel()
            await asyncio.gather(acquire, gone, return_exceptions=True)
        if acquire.done() and not acquire.cancelled() and acquire.exception() is None:
            return True
        return False

    @app.post("/v1/expertcache/replay")
    async def replay(request: HTTPRequest):
        try:
            path, opts = parse_replay(await json_body(request), trace_dirs)
        except ConfigError as e:
            return bad(e)
        if replays["waiting"] >= MAX_REPLAYS_WAITING:
            raise ServeError(429, f"{MAX_REPLAYS_WAITING} replays are waiting already; retry later",
                             code="too_many_replays", headers={"Retry-After": "2"})
        replays["waiting"] += 1
        try:
            entered = await acquire_unless_gone(request)  # one at a time: a 2,048-step replay is ~1.5 MB of JSON
        finally:
            replays["waiting"] -= 1
        if not entered:  # the client left while waiting: its place in the queue is free
            raise ClientGone()
        try:
            if app.state.shutting_down:
                raise ServeError(503, "the server is shutting down", code="shutting_down")
            return await run_replay(path, opts)
        finally:
            replays["lock"].release()

    async def run_replay(path: Path, opts: dict):
        try:
            trace = trace_cache.get(path)
            if trace is None:
                try:
                    trace = trace_cache[path] = await asyncio.to_thread(load_regular_trace, path)
                except (TraceError, OSError) as exc:
                    raise ConfigError("trace", f"cannot read {path.name}: {exc}") from None
            if opts["capacity"] > trace.meta.num_experts:
                raise ConfigError("capacity", f"must be between 1 and N={trace.meta.num_experts}, "
                                              f"got {opts['capacity']}")
            if opts["capacity"] < 1:
                raise ConfigError("capacity", f"must be >= 1, got {opts['capacity']}")
            if opts["routing"].top_j > trace.meta.top_k:
                raise ConfigError("top_j", f"exceeds K={trace.meta.top_k}")

            if not 0 <= opts["start"] < trace.num_tokens:
                raise ConfigError("start", f"must be in [0, {trace.num_tokens}), got {opts['start']}")
            try:
                body = await asyncio.to_thread(worker.run, path, opts)
            except OSError as exc:
                raise ServeError(503, public_message(f"replay: {exc}; retry", private + [path]),
                                 code="replay_failed") from None
            if body is None:  # a policy or eviction registered in this process only
                body = await asyncio.to_thread(replay_json, trace, opts)
            return Response(body, media_type="application/json")
        except ConfigError as e:
            return bad(e, path)
        except ValueError as e:  # the simulator refused the combination
            return bad(ConfigError("policy", str(e)), path)
