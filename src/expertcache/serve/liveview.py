"""The live view of the expert cache (issue 16): a page at ``/``, its event stream, live controls and trace replay.

Routes added to the serve app by :func:`install_liveview` (schema in ``docs/SERVE.md``, "Live view"):

- ``GET /`` and ``GET /static/<file>``: the page (plain HTML/JS/CSS shipped in ``serve/static``, no build step,
  nothing fetched from elsewhere);
- ``GET /v1/expertcache/events``: server-sent events, one JSON frame per model forward (per MoE layer: the
  experts requested, hits, misses, evictions, prefetches and the resident set after the step; running totals).
  Each subscriber has a bounded queue: when a page reads slower than the model decodes, its oldest frames are
  dropped (and counted), the engine thread never waits;
- ``GET /v1/expertcache/config``, ``POST /v1/expertcache/config``: the resolved routing policy, eviction and
  cache size the runtime really uses; a POST validates (400 with an OpenAI error body naming the field) and the
  engine thread applies it between two forwards (at once when idle);
- ``GET /v1/expertcache/traces``, ``POST /v1/expertcache/replay``: step through a routing trace (the shipped ones
  or ``--trace-dir``'s) under any policy, eviction and cache size with the simulator; per-step frames in the
  same schema as the live ones.

The tap only observes, through named hooks (docs/ARCHITECTURE.md, "Observing the runtime"): the runtime's step,
prefetch and router observers (one cache step per MoE layer per forward, prefetch loads, the router logits of
the shadow route) and the engine's forward observer (engine thread, after every forward).
"""


import asyncio
import collections
import json
import threading
import time
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
from starlette.responses import Response

from expertcache.routing.registry import NEEDS_PROFILE
from expertcache.cache import DEFAULT_GAMMA, EVICTIONS, LIVE_EVICTIONS, eviction_rule
from expertcache.routing import POLICIES, STRENGTH, Router, RoutingConfig

__all__ = ["install_liveview", "Broker", "Tap", "LiveControl", "replay_frames", "SCHEMA_VERSION", "shipped_traces"]

SCHEMA_VERSION = 1
STATIC = Path(__file__).with_name("static")
MAX_REPLAY_STEPS = 2048
#: event-stream subscribers at once (more get 429): each costs the engine thread a put per forward
MAX_SUBSCRIBERS = 16
#: a subscriber whose queue is full and that has not taken a frame for this long is dropped (its stream ends)
STALL_S = 10.0
#: replays waiting for the one that runs (more get 429); one runs at a time, built and serialised off the loop
MAX_REPLAYS_WAITING = 4


class ConfigError(ValueError):
    """A bad live-configuration or replay field; ``param`` names it (HTTP 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message if message.startswith(param) else f"{param}: {message}")
        self.param = param



# ---------------------------------------------------------------------------------------------
# the bounded fan-out


class Subscriber:
    """One event-stream client: a bounded deque filled by the engine thread, drained by the event loop.
    Full → the oldest frame is dropped (``dropped`` counts them); still dropping ``stall_s`` seconds after the
    first drop with no read between → the subscriber is ``stalled`` (the broker stops feeding it, its stream
    ends)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, maxlen: int, stall_s: float = STALL_S) -> None:
        self.loop = loop
        self.frames: collections.deque = collections.deque(maxlen=maxlen)
        self.lock = threading.Lock()
        self.dropped = 0
        self.delivered = 0
        self.ready = asyncio.Event()
        self._wake_pending = False
        self.stall_s = stall_s
        self.full_since: float | None = None  # when the queue first overflowed since the last take
        self.stalled = False

    def put(self, frame: dict) -> None:
        """Engine thread: never blocks (beyond a short lock), never grows past ``maxlen``."""
        with self.lock:
            if len(self.frames) == self.frames.maxlen:
                self.dropped += 1
                now = time.monotonic()
                if self.full_since is None:
                    self.full_since = now
                elif now - self.full_since > self.stall_s:
                    self.stalled = True
            self.frames.append(frame)
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self.ready.set)
        except RuntimeError:  # the loop is closed: nobody reads any more
            pass

    def take(self) -> list[dict]:
        with self.lock:
            out = list(self.frames)
            self.frames.clear()
            self._wake_pending = False
            self.ready.clear()
            self.delivered += len(out)
            self.full_since = None
        return out


class Broker:
    """Fan-out of frames to subscribers, each with its own bounded queue (``maxlen`` frames)."""

    def __init__(self, maxlen: int = 64, max_subscribers: int = MAX_SUBSCRIBERS, stall_s: float = STALL_S) -> None:
        self.maxlen, self.max_subscribers, self.stall_s = maxlen, max_subscribers, stall_s
        self._subs: list[Subscriber] = []
        self._lock = threading.Lock()
        self.published = 0
        self.stalled = 0  # subscribers dropped for not reading

    def subscribe(self, loop: asyncio.AbstractEventLoop) -> Subscriber | None:
        """A new subscriber, or None when ``max_subscribers`` already are."""
        s = Subscriber(loop, self.maxlen, self.stall_s)
        with self._lock:
            if len(self._subs) >= self.max_subscribers:
                return None
            self._subs = self._subs + [s]
        return s

    def unsubscribe(self, s: Subscriber) -> None:
        with self._lock:
            self._subs = [x for x in self._subs if x is not s]

    @property
    def subscribers(self) -> list[Subscriber]:
        return self._subs

    def publish(self, frame: dict) -> None:
        self.published += 1
        stalled = []
        for s in self._subs:  # a copy-on-write list: no lock needed to iterate
            s.put(frame)
            if s.stalled:
                stalled.append(s)
        for s in stalled:  # fell behind a full queue for stall_s: no more frames; its stream ends
            self.unsubscribe(s)
            self.stalled += 1
            try:
                s.loop.call_soon_threadsafe(s.ready.set)
            except RuntimeError:
                pass


# ---------------------------------------------------------------------------------------------
# the tap on the runtime


def _sorted(x) -> list[int]:
    return sorted(int(e) for e in x)


class Tap:
    """Records, per MoE layer, what each cache step did, and turns every forward into a frame.

    Observes through named hooks, changing nothing: the runtime's step, prefetch and router observers
    (:mod:`expertcache.offload.observe`, active only while someone subscribes) and the engine's forward
    observer (:meth:`Engine.add_forward_observer`, engine thread, after each forward). Frames are built only
    while someone subscribes; running totals always."""

    def __init__(self, engine, broker: Broker, control: "LiveControl | None" = None) -> None:
        self.rt, self.broker, self.control = engine.rt, broker, control
        self._acc = self._empty()
        self.seq = 0
        self.totals = dict(tokens=0, hits=0, misses=0, low_computes=0, prefetched=0, bytes_read=0, forwards=0, decode_tokens=0,
                           decode_bytes=0, decode_seconds=0.0)
        self._recent: collections.deque = collections.deque(maxlen=32)
        # the shadow: what original routing would have hit on the same tokens (cache-aware policies only)
        self.shadow: list | None = None
        self._shadow_acc = [0, 0]
        self.shadow_totals = dict(hits=0, misses=0, policy_hits=0, policy_misses=0, since_seq=0)
        subscribed = lambda: bool(self.broker.subscribers)  # noqa: E731
        self.rt.add_step_observer(self._on_cache_step, when=subscribed)
        self.rt.add_prefetch_observer(self._on_prefetch)  # always: the totals count prefetch loads
        self.rt.add_router_observer(self._on_route, when=lambda: subscribed() and self.rt.routing.cache_aware)
        engine.add_forward_observer(self._after_forward)

    def _on_cache_step(self, ev) -> None:
        a = self._acc[ev.layer]
        if ev.kind == "prefetch":  # OffloadedModel.prefetch's loads: not demand misses
            a["prefetched"].update(ev.admitted)
        else:
            a["requested"].extend(ev.order)
            for e, hit in zip(ev.order, ev.hits):
                (a["hit"] if hit else a["miss"]).add(e)
            a["low"].update(ev.low)  # computed at 4 bits instead of loaded (--resident-quant)
        a["evicted"].update(ev.evicted)

    def _on_prefetch(self, ev) -> None:
        if ev.kind == "explicit":
            self.totals["prefetched"] += len(ev.loaded)  # loads too: counted in the totals' transfers

    def _on_route(self, ev) -> None:
        self._shadow_route(self.rt.layers[ev.layer], ev.logits)

    def _after_forward(self, rows, tokens, seconds, delta) -> None:
        try:
            self._on_forward(rows, tokens, seconds, delta)
        finally:
            if self.control is not None:
                self.control.apply_pending()  # between two forwards, in the engine thread

    def _shadow_route(self, m, z_TE) -> None:
        """Route the forward's tokens at layer ``m`` with original routing and serve them from the shadow cache
        (the union of the rows' experts by total weight, as the runtime serves a step)."""
        from expertcache.cache import make_cache
        from expertcache.models.adapters import order_by_logits
        from expertcache.offload.step import union_order
        from expertcache.routing import topk_rank

        rt = self.rt
        if self.shadow is None:  # starts from what the live caches hold now
            self.shadow = [make_cache(rt.eviction, rt.num_experts, rt.capacity, gamma=rt.gamma,
                                      initial=sorted(st.cache.resident()))
                           for st in rt.states]
            self.shadow_totals = dict(hits=0, misses=0, policy_hits=0, policy_misses=0, since_seq=self.seq + 1)
        z_cpu_TE = z_TE.detach().to("cpu")
        zr_TE, allowed_TE = rt.family.ranking(m.router, z_cpu_TE)
        if allowed_TE is not None:
            zr_TE = zr_TE.masked_fill(~allowed_TE, float("-inf"))
        ids_TK = order_by_logits(topk_rank(zr_TE, rt.top_k), z_cpu_TE)
        w_TK = None if ids_TK.shape[0] == 1 else rt.family.weights(m.router, z_cpu_TE, ids_TK)  # one token: its order
        order = union_order(ids_TK, w_TK, rt.num_experts)
        hits = self.shadow[m.index].access_step(order)
        self._shadow_acc[0] += sum(hits)
        self._shadow_acc[1] += len(hits) - sum(hits)

    def _empty(self) -> list[dict]:
        return [dict(requested=[], hit=set(), miss=set(), low=set(), evicted=set(), prefetched=set())
                for _ in self.rt.layers]

    def _on_forward(self, rows: int, tokens: int, seconds: float, delta: dict) -> None:
        t = self.totals
        h, m, b = int(round(delta["hits"])), int(round(delta["misses"])), int(delta["bytes_read"])
        t["tokens"] += tokens
        t["hits"] += h
        t["misses"] += m
        t["low_computes"] += int(round(delta.get("low_computes", 0)))
        t["bytes_read"] += b
        t["forwards"] += 1
        if rows:  # a decode step
            t["decode_tokens"] += tokens
            t["decode_bytes"] += b
            t["decode_seconds"] += seconds
            self._recent.append((tokens, seconds))
        if not self.broker.subscribers:
            self._acc = self._empty()
            self._shadow_acc = [0, 0]
            self.shadow = None
            return
        acc, self._acc = self._acc, self._empty()
        self.seq += 1
        n_s = sum(s for _, s in self._recent)
        layers = []
        for st, a in zip(self.rt.states, acc):
            layers.append(dict(requested=a["requested"], hit=_sorted(a["hit"]), miss=_sorted(a["miss"]),
                               low=_sorted(a["low"]),
                               evicted=_sorted(a["evicted"]), prefetched=_sorted(a["prefetched"]),
                               resident=_sorted(st.cache.resident())))
        acc_n = t["hits"] + t["misses"]
        shadow = None
        if self.shadow is not None and self.rt.routing.cache_aware:
            sh = self.shadow_totals
            sh["hits"] += self._shadow_acc[0]
            sh["misses"] += self._shadow_acc[1]
            sh["policy_hits"] += h
            sh["policy_misses"] += m
            n0, n1 = sh["hits"] + sh["misses"], sh["policy_hits"] + sh["policy_misses"]
            shadow = dict(sh, hit_rate=sh["hits"] / n0 if n0 else None,
                          policy_hit_rate=sh["policy_hits"] / n1 if n1 else None)
        self._shadow_acc = [0, 0]
        frame = dict(type="step", seq=self.seq, time=time.time(), phase="decode" if rows else "prefill", rows=rows,
                     tokens=tokens, seconds=seconds, hits=h, misses=m, bytes_read=b, layers=layers,
                     totals=dict(t, hit_rate=(t["hits"] / acc_n) if acc_n else None,
                                 transfers=t["misses"] + t["prefetched"],
                                 bytes_per_token=(t["decode_bytes"] / t["decode_tokens"]) if t["decode_tokens"]
                                 else None,
                                 tok_s=(sum(n for n, _ in self._recent) / n_s) if n_s > 0 else None),
                     original=shadow)
        self.broker.publish(frame)


# ---------------------------------------------------------------------------------------------
# live configuration


_ROUTING_FIELDS = {f.name: f for f in fields(RoutingConfig)}
_INT_FIELDS = {"top_j", "h", "m", "capacity"}


def _check_fields(body, extra: set, what: str) -> None:
    """``body`` is a JSON object whose fields are routing fields or ``extra`` ones (ConfigError naming it)."""
    if not isinstance(body, dict):
        raise ConfigError("body", "must be a JSON object")
    unknown = sorted(set(body) - set(_ROUTING_FIELDS) - extra)
    if unknown:
        raise ConfigError(unknown[0], f"unknown field; {what} {sorted(set(_ROUTING_FIELDS) | extra)}")


def _check_number(key: str, v, integer: bool) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ConfigError(key, f"must be {'an integer' if integer else 'a number'}, got {json.dumps(v)[:40]}")
    if isinstance(v, float) and v != v:
        raise ConfigError(key, "must be a number, got NaN")


class LiveControl:
    """What the runtime allows changing while it serves: routing policy and its parameters (λ ...), top-J,
    eviction, γ and the cache size C. :meth:`request` validates in the caller's thread; the engine thread
    applies the change (:meth:`apply_pending`) between two forwards, or the caller does at once when the
    engine is idle (holding the engine's lock, so no forward can start meanwhile).

    A routing change swaps the router and keeps the caches (their contents and statistics); an eviction, γ
    or cache-size change restarts the caches empty (``OffloadedModel.configure``)."""

    def __init__(self, engine, broker: Broker) -> None:
        self.engine, self.rt, self.broker = engine, engine.rt, broker
        self._pending: dict | None = None
        self._lock = threading.Lock()
        self.version = 0
        self.tap: Tap | None = None

    def resolved(self) -> dict:
        rt = self.rt
        return dict(routing=rt.routing.to_dict(), label=rt.routing.label(), cache_aware=rt.routing.cache_aware,
                    strength=STRENGTH[rt.routing.policy],
                    eviction=rt.eviction, gamma=rt.gamma, capacity=rt.capacity,
                    num_experts=rt.num_experts, top_k=rt.top_k, moe_layers=len(rt.layers),
                    expert_bytes=rt.expert_bytes, version=self.version, pending=self._pending is not None,
                    choices=dict(policy=list(POLICIES), eviction=list(LIVE_EVICTIONS),
                                 replay_eviction=list(EVICTIONS), strength=dict(STRENGTH)))

    def validate(self, body) -> dict:
        """The change as a plan ``{routing, router, eviction, gamma, capacity}`` or :class:`ConfigError`."""
        rt = self.rt
        _check_fields(body, {"eviction", "gamma", "capacity"}, "the live configuration has")
        routing = rt.routing.to_dict()
        if "policy" in body and body["policy"] != routing["policy"]:
            # a new policy starts from its defaults (and the current top-J) unless fields are given
            routing = dict(RoutingConfig().to_dict(), top_j=routing["top_j"])
        cfg = _routing_from(body, routing)
        if cfg.h is not None and not 1 <= cfg.h <= rt.top_k:
            raise ConfigError("h", f"must be in [1, K={rt.top_k}], got {cfg.h}")
        eviction = body.get("eviction", rt.eviction)
        if not isinstance(eviction, str) or eviction not in LIVE_EVICTIONS:
            raise ConfigError("eviction", f"must be one of {list(LIVE_EVICTIONS)} live (belady needs the future: "
                                          f"use the replay), got {json.dumps(eviction)[:40]}")
        gamma = body.get("gamma", rt.gamma)
        _check_number("gamma", gamma, False)
        if not 0 < gamma <= 1:
            raise ConfigError("gamma", f"must be in (0, 1], got {gamma}")
        capacity = body.get("capacity", rt.capacity)
        _check_number("capacity", capacity, True)
        if not 1 <= capacity <= rt.num_experts:
            raise ConfigError("capacity", f"must be between 1 and N={rt.num_experts}, got {capacity}")
        freq = getattr(rt.router, "freq_LE", None)
        try:
            router = Router(cfg, num_experts=rt.num_experts, k=rt.top_k, renormalize=rt.renormalize,
                            scoring=rt.family.scoring, freq_LE=freq)
        except ValueError as exc:
            raise ConfigError(_culprit(str(exc), body), str(exc)) from None
        return dict(routing=cfg, router=router, eviction=eviction, gamma=float(gamma), capacity=int(capacity))

    def _apply_if_idle(self) -> None:
        self.engine.run_if_idle(self.apply_pending)  # idle: no forward can start meanwhile

    def request(self, body) -> dict:
        """Validate and queue ``body``; applied at once when the engine is idle. Returns the resolved config."""
        plan = self.validate(body)
        with self._lock:
            self._pending = plan
        self._apply_if_idle()
        return self.resolved()

    async def request_async(self, body, timeout: float = 10.0) -> dict:
        """:meth:`request`, then wait (without blocking the event loop) until the engine thread has applied it
        after its next forward, or the engine went idle first (then apply it here)."""
        self.request(body)
        deadline = time.monotonic() + timeout
        while self._pending is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
            self._apply_if_idle()
        return self.resolved()

    def apply_pending(self) -> None:
        with self._lock:
            plan, self._pending = self._pending, None
        if plan is None:
            return
        rt = self.rt
        if (plan["eviction"], plan["capacity"], plan["gamma"]) != (rt.eviction, rt.capacity, rt.gamma):
            freq = getattr(rt.router, "freq_LE", None)
            rt.configure(routing=plan["routing"], eviction=plan["eviction"], gamma=plan["gamma"],
                         capacity=plan["capacity"], freq_LE=None if freq is None else freq.numpy())
        else:
            rt.routing, rt.router = plan["routing"], plan["router"]
        self.version += 1
        if self.tap is not None:  # the shadow caches restart from the live caches' contents
            self.tap.shadow = None
        self.broker.publish(dict(type="config", config=self.resolved(), time=time.time()))


def _routing_from(body: dict, base: dict) -> RoutingConfig:
    """``base`` (RoutingConfig fields) updated with ``body``'s routing fields, type-checked and validated."""
    routing = dict(base)
    for k in _ROUTING_FIELDS:
        if k not in body:
            continue
        v = body[k]
        if k == "policy":
            if v not in POLICIES:
                raise ConfigError("policy", f"unknown policy {json.dumps(v)[:40]}; choose one of {list(POLICIES)}")
        elif not (k in ("h", "delta") and v is None):
            _check_number(k, v, k in _INT_FIELDS)
        routing[k] = v
    try:
        return RoutingConfig(**routing)
    except (ValueError, TypeError) as exc:
        raise ConfigError(_culprit(str(exc), body), str(exc)) from None


def _culprit(message: str, body: dict) -> str:
    for k in sorted(body, key=len, reverse=True):
        if message.lower().startswith(k.lower()) or f" {k} " in message or f"{k}=" in message:
            return k
    if "top-J" in message:
        return "top_j"
    return "policy" if "policy" in body else next(iter(body), "body")


# ---------------------------------------------------------------------------------------------
# replay


def shipped_traces() -> dict[str, Path]:
    d = Path(__file__).resolve().parent.parent / "assets" / "traces"
    return {p.name: p for p in sorted(d.glob("*.trace.safetensors"))}


def list_traces(trace_dirs) -> dict[str, Path]:
    """The shipped traces and ``trace_dirs``' ``*.trace.safetensors`` regular files (not a FIFO, device or
    folder of that name: reading one would block)."""
    out = shipped_traces()
    for d in trace_dirs:
        for p in sorted(Path(d).glob("*.trace.safetensors")):
            if p.is_file():
                out.setdefault(p.name, p)
    return out


def load_regular_trace(path: Path):
    """:meth:`RoutingTrace.load`, after checking (opened non-blocking, so a FIFO cannot block the check) that
    ``path`` is a regular file: OSError naming it otherwise."""
    import os
    import stat

    from expertcache.trace.format import RoutingTrace

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path.name} is not a regular file")
    finally:
        os.close(fd)
    return RoutingTrace.load(path)


def replay_json(trace, opts: dict) -> bytes:
    """:func:`replay_frames` of ``trace`` with ``opts`` (:func:`parse_replay`'s) as compact JSON bytes."""
    return json.dumps(replay_frames(trace, opts["routing"], opts["capacity"], eviction=opts["eviction"],
                                    gamma=opts["gamma"], start=opts["start"], steps=opts["steps"]),
                      separators=(",", ":")).encode()


class ReplayWorker:
    """Replays in a child process (``python -c ...replay_worker_main()``, one request at a time over pipes, JSON
    both ways: nothing unpickled). A replay is seconds of Python (the simulator, then ~1.5 MB of JSON for 2,048
    steps); in a thread of the server it holds the GIL against the engine thread and the event loop (a running
    stream waited 1.3 s behind four replays), in its own process it only takes a core. Started on first use,
    restarted if it died. A policy or eviction the child does not know (registered in this process at run
    time) makes :meth:`run` return None: the caller replays in a thread instead."""

    def __init__(self) -> None:
        self.proc = None
        self.lock = threading.Lock()

    def _start(self) -> None:
        import os
        import subprocess
        import sys

        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", "from expertcache.serve.liveview import "
                                      "replay_worker_main; replay_worker_main()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def run(self, path: Path, opts: dict) -> bytes | None:
        """Blocking (call it from a worker thread): the replay's JSON bytes, None (see the class), or the
        child's :class:`ConfigError` / ``ValueError`` re-raised; OSError if the child died twice."""
        from expertcache.jsonsafe import loads

        req = json.dumps(dict(path=str(path), routing=opts["routing"].to_dict(),
                              **{k: opts[k] for k in ("capacity", "eviction", "gamma", "start", "steps")}))
        with self.lock:
            for attempt in range(2):
                if self.proc is None or self.proc.poll() is not None:
                    self._start()
                try:
                    self.proc.stdin.write(req.encode() + b"\n")
                    self.proc.stdin.flush()
                    kind, n = self.proc.stdout.readline().split()
                    body = self.proc.stdout.read(int(n))
                    if len(body) != int(n):
                        raise EOFError
                except (OSError, ValueError, EOFError):
                    self.close()
                    if attempt:
                        raise OSError("the replay process stopped") from None
                    continue
                if kind == b"ok":
                    return body
                err = loads(body, "the replay process's answer")
                if err["kind"] == "unknown":
                    return None
                if err["kind"] == "config":
                    raise ConfigError(err["param"], err["message"])
                raise ValueError(err["message"])


def replay_worker_main() -> None:
    """The replay child (:class:`ReplayWorker`): one JSON request per line on stdin; answers ``ok N`` or
    ``err N`` then N bytes on stdout."""
    import sys

    from expertcache.jsonsafe import loads

    out, traces = sys.stdout.buffer, {}

    def reply(kind: str, body: bytes) -> None:
        out.write(f"{kind} {len(body)}\n".encode() + body)
        out.flush()

    for line in sys.stdin.buffer:
        try:
            req = loads(line, "replay request")
            try:
                routing = RoutingConfig.from_dict(req["routing"])
                eviction_rule(req["eviction"])
            except (ValueError, KeyError, TypeError) as exc:  # registered in the server only
                reply("err", json.dumps(dict(kind="unknown", message=str(exc))).encode())
                continue
            trace = traces.get(req["path"])
            if trace is None:
                trace = traces[req["path"]] = load_regular_trace(Path(req["path"]))
            reply("ok", replay_json(trace, dict(req, routing=routing)))
        except ConfigError as e:
            reply("err", json.dumps(dict(kind="config", param=e.param, message=str(e))).encode())
        except Exception as e:  # noqa: BLE001 - the simulator refused the combination, or a bad trace
            reply("err", json.dumps(dict(kind="value", message=f"{type(e).__name__}: {e}")).encode())


_replay_worker = ReplayWorker()


class TimedStream(Response):
    """A server-sent-event response for the live view: each write waits ``send_timeout`` seconds at most (a
    client that stopped reading fills the socket, then is cut off: uvicorn closes the connection), and the
    subscriber ``sub`` is marked stalled then."""

    def __init__(self, chunks, sub: Subscriber, send_timeout: float = STALL_S) -> None:
        super().__init__(media_type="text/event-stream")
        self.chunks, self.sub, self.send_timeout = chunks, sub, send_timeout

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        try:
            async for chunk in self.chunks:
                try:
                    await asyncio.wait_for(send({"type": "http.response.body", "body": chunk.encode(),
                                                 "more_body": True}), self.send_timeout)
                except asyncio.TimeoutError:
                    self.sub.stalled = True
                    return  # incomplete: the server drops the connection
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.chunks.aclose()


def replay_frames(trace, routing: RoutingConfig, capacity: int, *, eviction: str = "lru", gamma: float = DEFAULT_GAMMA,
                  start: int = 0, steps: int = 256) -> dict:
    """Tokens ``start .. start+steps`` of ``trace`` under ``routing`` / ``eviction`` / ``capacity`` through
    :func:`expertcache.sim.simulate` (one sequence, caches carried, empty at ``start``), then the served
    selections stepped through one fresh cache per layer to get per-step frames (same schema as the live
    ones). ``result`` holds the simulator's per-layer counts: the frames add up to them."""
    from expertcache.cache import make_cache
    from expertcache.sim import activation_frequency, simulate
    from expertcache.trace.format import RoutingTrace

    meta = trace.meta
    if not 0 <= start < trace.num_tokens:
        raise ConfigError("start", f"must be in [0, {trace.num_tokens}), got {start}")
    stop = min(trace.num_tokens, start + steps)
    part = RoutingTrace(logits_TLE=np.asarray(trace.logits_TLE[start:stop]),
                        ids_TLK=np.asarray(trace.ids_TLK[start:stop]), meta=replace(meta, sequence_starts=[0]))
    freq = activation_frequency(trace.ids_TLK, meta.num_experts) if routing.policy in NEEDS_PROFILE else None
    res = simulate(part, routing, capacity, eviction=eviction, gamma=gamma, freq_LE=freq)
    served_TLK = np.asarray(res.ids_TLK)
    T, L, _ = served_TLK.shape
    layer_steps = [served_TLK[:, li, :].tolist() for li in range(L)]
    caches = [make_cache(eviction, meta.num_experts, capacity, gamma=gamma, seed=li,
                         future=[[e for e in s if e >= 0] for s in layer_steps[li]] if eviction_rule(eviction).offline
                         else None)
              for li in range(L)]
    frames = []
    hits = misses = 0
    for t in range(T):
        layers = []
        h_t = m_t = 0
        for li, cache in enumerate(caches):
            order = [int(e) for e in layer_steps[li][t] if e >= 0]
            before = cache.resident()
            hit = cache.access_step(order)
            after = cache.resident()
            h_t += sum(hit)
            m_t += len(hit) - sum(hit)
            layers.append(dict(requested=order, hit=sorted(e for e, x in zip(order, hit) if x),
                               miss=sorted(e for e, x in zip(order, hit) if not x), low=[],
                               evicted=_sorted(before - after),
                               prefetched=[], resident=_sorted(after)))
        hits += h_t
        misses += m_t
        frames.append(dict(type="step", seq=t + 1, step=start + t, phase="replay", rows=1, tokens=1, hits=h_t,
                           misses=m_t, layers=layers,
                           totals=dict(tokens=t + 1, hits=hits, misses=misses,
                                       hit_rate=hits / (hits + misses) if hits + misses else None)))
    per_layer = [dict(hits=s.hits, misses=s.misses, accesses=s.accesses) for s in res.per_layer]
    return dict(type="replay", trace=dict(model=meta.model, source=meta.source, num_tokens=trace.num_tokens,
                                          num_experts=meta.num_experts, top_k=meta.top_k, num_layers=L),
                config=dict(routing=routing.to_dict(), label=routing.label(), eviction=eviction, gamma=gamma,
                            capacity=capacity, start=start, steps=T),
                result=dict(miss_rate=res.miss_rate, per_layer=per_layer), frames=frames)


def parse_replay(body, trace_dirs) -> tuple[Path, dict]:
    _check_fields(body, {"trace", "capacity", "eviction", "gamma", "start", "steps"}, "a replay takes")
    traces = list_traces(trace_dirs)
    name = body.get("trace")
    if name not in traces:
        raise ConfigError("trace", f"unknown trace {json.dumps(name)[:80]}; available: {sorted(traces)}")
    cfg = _routing_from(body, {})
    eviction = body.get("eviction", "lru")
    if not isinstance(eviction, str) or eviction not in EVICTIONS:
        raise ConfigError("eviction", f"must be one of {', '.join(EVICTIONS)}, got {json.dumps(eviction)[:40]}")
    if eviction_rule(eviction).offline and cfg.cache_aware:
        raise ConfigError("eviction", "belady needs fixed selections: only with policy original or prune")
    out = dict(routing=cfg, eviction=eviction)
    for k, default, integer in (("capacity", 8, True), ("gamma", DEFAULT_GAMMA, False), ("start", 0, True), ("steps", 256, True)):
        v = body.get(k, default)
        _check_number(k, v, integer)
        out[k] = v
    if not 0 < out["gamma"] <= 1:
        raise ConfigError("gamma", f"must be in (0, 1], got {out['gamma']}")
    if not 1 <= out["steps"] <= MAX_REPLAY_STEPS:
        raise ConfigError("steps", f"must be in [1, {MAX_REPLAY_STEPS}], got {out['steps']}")
    return traces[name], out


# ---------------------------------------------------------------------------------------------
# routes


def install_liveview(app, engine, *, trace_dirs=(), queue_frames: int = 64) -> None:
    """Add the page, the event stream, the live controls and the replay to the serve ``app``."""
    from fastapi import Request as HTTPRequest
    from fastapi.responses import FileResponse, JSONResponse

    from expertcache.serve.app import ServeError, json_body as read_json
    from expertcache.trace.format import RoutingTrace, TraceError

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

    def bad(e: ConfigError) -> JSONResponse:
        return JSONResponse(ServeError(400, str(e), param=e.param, code="invalid_value").body(), status_code=400)

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
                layers = [dict(resident=_sorted(st.cache.resident())) for st in rt.states]
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
                while not app.state.shutting_down and not sub.stalled:
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

    replays = dict(lock=asyncio.Lock(), waiting=0)

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
        entered = False
        try:
            async with replays["lock"]:  # one at a time: a 2,048-step replay is ~1.5 MB of JSON
                replays["waiting"] -= 1
                entered = True
                return await run_replay(path, opts)
        finally:
            if not entered:  # the client left while waiting
                replays["waiting"] -= 1

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
                body = await asyncio.to_thread(_replay_worker.run, path, opts)
            except OSError as exc:
                raise ServeError(503, f"replay: {exc}; retry", code="replay_failed") from None
            if body is None:  # a policy or eviction registered in this process only
                body = await asyncio.to_thread(replay_json, trace, opts)
            return Response(body, media_type="application/json")
        except ConfigError as e:
            return bad(e)
        except ValueError as e:  # the simulator refused the combination
            return bad(ConfigError("policy", str(e)))
