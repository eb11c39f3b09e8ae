"""The completion routes: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` = server-sent events), ``GET /health`` and ``GET /metrics``
(Prometheus text format), over an :class:`~expertcache.serve.engine.Engine`.

Every response (and the last stream chunk) carries an ``expertcache`` object — the request's share of expert-cache
hits, misses and bytes read (see the engine docstring), the policy, eviction and C; with ``"return_token_ids":
true`` it also lists the generated token ids. Parsing and tokenising (:func:`~expertcache.serve.schema.parse_body`)
run in a worker thread, never on the event loop."""

import asyncio
import json
import time
import uuid

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from expertcache.serve.engine import Engine, QueueFull, Request, ShuttingDown
from expertcache.serve.errors import RETRY_AFTER_503, ServeError, error_response
from expertcache.serve.metrics import Metrics
from expertcache.serve.schema import Validator, parse_body

__all__ = ["install_completions"]


def install_completions(app, engine: Engine, model_id: str, validator: Validator, metrics: Metrics) -> None:
    """Add the routes of the module docstring to ``app`` (whose ``state.shutting_down`` makes new requests 503)."""
    rt = engine.rt
    created = int(time.time())

    def err(e: ServeError, route: str) -> JSONResponse:
        return error_response(e, route, metrics)

    def policy() -> dict:
        return dict(policy=rt.routing.label(), eviction=rt.eviction, capacity=rt.capacity,
                    num_experts=rt.num_experts, moe_layers=len(rt.layers))

    def ec_object(info: dict, want_ids: bool) -> dict:
        acc = info["hits"] + info["misses"]
        d = dict(hits=round(info["hits"], 3), misses=round(info["misses"], 3),
                 low_computes=round(info.get("low_computes", 0.0), 3),  # misses computed at 4 bits (--resident-quant)
                 bytes_read=int(round(info["bytes_read"])), hit_rate=(info["hits"] / acc) if acc else None,
                 forwards=info["forwards"], mean_batch=round(info["mean_batch"], 3), ttft_s=info["ttft_s"],
                 **policy())
        if want_ids:
            d["token_ids"] = info["token_ids"]
        return d

    def usage(info: dict) -> dict:
        return dict(prompt_tokens=info["prompt_tokens"], completion_tokens=info["completion_tokens"],
                    total_tokens=info["prompt_tokens"] + info["completion_tokens"])

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse({"status": "failed", "error": str(engine.error)}, status_code=500)
        if app.state.shutting_down or not engine.accepting:
            return JSONResponse({"status": "shutting_down"}, status_code=503, headers={"Retry-After": RETRY_AFTER_503})
        return {"status": "ok", "model": model_id, "batch": engine.batch_size(), "queue": engine.queue_length()}

    @app.get("/metrics")
    async def metrics_route():
        metrics.on_queue(engine.queue_length(), engine.batch_size())
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_object() -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "expertcache",
                "expertcache": policy()}

    @app.get("/v1/models")
    async def models():
        metrics.requests.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [model_object()]}

    @app.get("/v1/models/{name:path}")
    async def model_retrieve(name: str):
        if name not in validator.model_ids:
            return err(ServeError(404, f"the model {name!r} does not exist; this server serves "
                                       f"{validator.model_ids}", param="model", code="model_not_found"),
                       "/v1/models/{id}")
        metrics.requests.labels("/v1/models/{id}", "200").inc()
        return model_object()

    async def handle(request: HTTPRequest, chat: bool):
        route = request.url.path
        try:
            if app.state.shutting_down:
                raise ServeError(503, "the server is shutting down", code="shutting_down")
            raw = await request.body()  # bounded, timed by the Guard
            p = await asyncio.to_thread(parse_body, validator, raw, chat)
            if app.state.shutting_down:
                raise ServeError(503, "the server is shutting down", code="shutting_down")
        except ServeError as e:
            return err(e, route)

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(kind, payload):
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
            except RuntimeError:  # the loop is gone (server stopped): nobody is listening
                pass

        req = Request(p.prompt_ids, p.params, on_event)
        try:
            engine.submit(req)
        except QueueFull as e:
            return err(ServeError(429, str(e), code="queue_full", headers={"Retry-After": "1"}), route)
        except ShuttingDown as e:
            return err(ServeError(503, str(e), code="shutting_down"), route)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"

        if not p.stream:
            checked = time.monotonic()
            try:
                while True:
                    try:
                        kind, payload = await asyncio.wait_for(events.get(), timeout=0.25)
                    except asyncio.TimeoutError:
                        kind = None
                    if time.monotonic() - checked >= 0.25:  # tokens may keep coming: check on a clock
                        checked = time.monotonic()
                        if await request.is_disconnected():
                            req.cancel()
                            return err(ServeError(499, "client disconnected"), route)
                    if kind == "error":
                        return err(ServeError(payload[0], payload[1]), route)
                    if kind == "done":  # the text pieces are in info["text"] too
                        info = payload
                        break
            finally:
                if req.finish_reason is None:
                    req.cancel()
            out = {"message": {"role": "assistant", "content": info["text"]}} if chat else {"text": info["text"]}
            choice = {"index": 0, **out, "finish_reason": info["finish_reason"], "logprobs": None}
            metrics.requests.labels(route, "200").inc()
            if info["ttft_s"] is not None:
                metrics.ttft.observe(info["ttft_s"])
            return {"id": rid, "object": obj, "created": int(time.time()), "model": model_id, "choices": [choice],
                    "usage": usage(info), "expertcache": ec_object(info, p.return_token_ids)}

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant"} if role else {}
                if delta_text is not None:
                    delta["content"] = delta_text
                c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                c = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            return {"id": rid, "object": chunk_obj, "created": int(time.time()), "model": model_id, "choices": [c]}

        def sse(d: dict) -> str:
            return f"data: {json.dumps(d)}\n\n"

        async def stream():
            status = "200"
            try:
                if chat:
                    yield sse(chunk("", None, role=True))
                while True:
                    kind, payload = await events.get()
                    if kind == "text":
                        yield sse(chunk(payload, None))
                    elif kind == "error":
                        status = str(payload[0])
                        yield sse(ServeError(payload[0], payload[1]).body())
                        break
                    else:
                        info = payload
                        last = chunk(None if chat else "", info["finish_reason"])
                        last["usage"] = usage(info)
                        last["expertcache"] = ec_object(info, p.return_token_ids)
                        yield sse(last)
                        if p.include_usage:
                            yield sse({**chunk(None, None), "choices": [], "usage": usage(info)})
                        if info["ttft_s"] is not None:
                            metrics.ttft.observe(info["ttft_s"])
                        break
                yield "data: [DONE]\n\n"
            finally:  # the client went away (or we are done): leave the batch at the next step
                if req.finish_reason is None:
                    req.cancel()
                    status = "499"
                metrics.requests.labels(route, status).inc()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await handle(request, chat=True)

