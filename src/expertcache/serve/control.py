"""Live configuration (:class:`LiveControl`): the routing policy and its parameters, eviction, γ and the cache
size C changed while the server runs, validated here (:class:`ConfigError` naming the field) and applied by the
engine thread between two forwards."""

import asyncio
import json
import threading
import time
from dataclasses import fields

from expertcache.cache import LIVE_EVICTIONS, EVICTIONS
from expertcache.routing import POLICIES, STRENGTH, Router, RoutingConfig
from expertcache.serve.broker import Broker

__all__ = ["LiveControl", "ConfigError"]


class ConfigError(ValueError):
    """A bad live-configuration or replay field; ``param`` names it (HTTP 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message if message.startswith(param) else f"{param}: {message}")
        self.param = param



_ROUTING_FIELDS = {f.name: f for f in fields(RoutingConfig)}
_INT_FIELDS = {"top_j", "h", "m", "capacity"}


def check_fields(body, extra: set, what: str) -> None:
    """``body`` is a JSON object whose fields are routing fields or ``extra`` ones (ConfigError naming it)."""
    if not isinstance(body, dict):
        raise ConfigError("body", "must be a JSON object")
    unknown = sorted(set(body) - set(_ROUTING_FIELDS) - extra)
    if unknown:
        raise ConfigError(unknown[0], f"unknown field; {what} {sorted(set(_ROUTING_FIELDS) | extra)}")


def check_number(key: str, v, integer: bool) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ConfigError(key, f"must be {'an integer' if integer else 'a number'}, got {json.dumps(v)[:40]}")
    if isinstance(v, float) and v != v:
        raise ConfigError(key, "must be a number, got NaN")


class LiveControl:
    """What the runtime allows changing while it serves: routing policy and its parameters (λ ...), top-J,
    eviction, γ and the cache size C. :meth:`request` validates in the caller's thread; the engine thread
    applies the change (:meth:`apply_pending`) between two forwards, or the caller does at once when the
    engine is idle (holding the engine's lock, so no forward can start meanwhile).

    Changes are serialised: each is validated against the state the changes before it produce (the one waiting
    to be applied, else the runtime's), given the next version number, and replaces the waiting one, which it
    includes; so concurrent changes are never lost (a λ-only change does not undo a cache-size change sent a
    moment before), and each reply is the state its own change produced, with its version.

    A routing change swaps the router and keeps the caches (their contents and statistics); an eviction, γ
    or cache-size change restarts the caches empty (``OffloadedModel.configure``)."""

    def __init__(self, engine, broker: Broker) -> None:
        self.engine, self.rt, self.broker = engine, engine.rt, broker
        self._pending: dict | None = None
        self._lock = threading.RLock()  # held to validate against, queue and apply a change
        self.version = 0  # the version the runtime runs
        self._issued = 0  # the last version given to a change
        self.tap = None  # the Tap whose shadow caches restart with a change (set by the installer)

    def _describe(self, routing: RoutingConfig, eviction: str, gamma: float, capacity: int, version: int,
                  pending: bool) -> dict:
        rt = self.rt
        return dict(routing=routing.to_dict(), label=routing.label(), cache_aware=routing.cache_aware,
                    strength=STRENGTH[routing.policy],
                    eviction=eviction, gamma=gamma, capacity=capacity,
                    num_experts=rt.num_experts, top_k=rt.top_k, moe_layers=len(rt.layers),
                    expert_bytes=rt.expert_bytes, version=version, pending=pending,
                    choices=dict(policy=list(POLICIES), eviction=list(LIVE_EVICTIONS),
                                 replay_eviction=list(EVICTIONS), strength=dict(STRENGTH)))

    def resolved(self) -> dict:
        """What the runtime runs now (``pending``: a change waits to be applied)."""
        with self._lock:
            rt = self.rt
            return self._describe(rt.routing, rt.eviction, rt.gamma, rt.capacity, self.version,
                                  self._pending is not None)

    def _base(self) -> dict:
        """The state a new change starts from: the waiting change's, else the runtime's."""
        if self._pending is not None:
            return self._pending
        rt = self.rt
        return dict(routing=rt.routing, eviction=rt.eviction, gamma=rt.gamma, capacity=rt.capacity)

    def validate(self, body, base: dict | None = None) -> dict:
        """The change ``body`` over ``base`` (default: :meth:`_base`) as a plan ``{routing, router, eviction,
        gamma, capacity}``, or :class:`ConfigError`."""
        rt = self.rt
        with self._lock:
            base = self._base() if base is None else base
        check_fields(body, {"eviction", "gamma", "capacity"}, "the live configuration has")
        routing = base["routing"].to_dict()
        if "policy" in body and body["policy"] != routing["policy"]:
            # a new policy starts from its defaults (and the current top-J) unless fields are given
            routing = dict(RoutingConfig().to_dict(), top_j=routing["top_j"])
        cfg = routing_from(body, routing)
        if cfg.h is not None and not 1 <= cfg.h <= rt.top_k:
            raise ConfigError("h", f"must be in [1, K={rt.top_k}], got {cfg.h}")
        eviction = body.get("eviction", base["eviction"])
        if not isinstance(eviction, str) or eviction not in LIVE_EVICTIONS:
            raise ConfigError("eviction", f"must be one of {list(LIVE_EVICTIONS)} live (belady needs the future: "
                                          f"use the replay), got {json.dumps(eviction)[:40]}")
        gamma = body.get("gamma", base["gamma"])
        check_number("gamma", gamma, False)
        if not 0 < gamma <= 1:
            raise ConfigError("gamma", f"must be in (0, 1], got {gamma}")
        capacity = body.get("capacity", base["capacity"])
        check_number("capacity", capacity, True)
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

    def _queue(self, body) -> dict:
        with self._lock:
            plan = self.validate(body, self._base())
            self._issued += 1
            plan["version"] = self._issued
            self._pending = plan
        return plan

    def _reply(self, plan: dict) -> dict:
        return self._describe(plan["routing"], plan["eviction"], plan["gamma"], plan["capacity"], plan["version"],
                              self.version < plan["version"])

    def request(self, body) -> dict:
        """Validate and queue ``body``; applied at once when the engine is idle. Returns the state this change
        produces, with its version (``pending``: not applied yet)."""
        plan = self._queue(body)
        self._apply_if_idle()
        return self._reply(plan)

    async def request_async(self, body, timeout: float = 10.0) -> dict:
        """:meth:`request`, then wait (without blocking the event loop) until the engine thread has applied it
        after its next forward, or the engine went idle first (then apply it here)."""
        plan = self._queue(body)
        self._apply_if_idle()
        deadline = time.monotonic() + timeout
        while self.version < plan["version"] and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
            self._apply_if_idle()
        return self._reply(plan)

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
            self.version = plan.get("version", self.version + 1)
            if self.tap is not None:  # the shadow caches restart from the live caches' contents
                self.tap.shadow = None
            self.broker.publish(dict(type="config", config=self.resolved(), time=time.time()))


def routing_from(body: dict, base: dict) -> RoutingConfig:
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
            check_number(k, v, k in _INT_FIELDS)
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
