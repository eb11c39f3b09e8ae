"""Trace replay: the routing traces a server may open (:func:`list_traces`), a replay request's fields
(:func:`parse_replay`) and the replay itself (:func:`replay_frames`: the simulator, then per-step frames in the
live view's schema). Pure functions: the process that runs them is :mod:`expertcache.serve.replay_child`'s."""

import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import numpy as np

from expertcache.cache import DEFAULT_GAMMA, EVICTIONS, eviction_rule, make_cache
from expertcache.routing import RoutingConfig
from expertcache.routing.registry import NEEDS_PROFILE
from expertcache.sim import activation_frequency, simulate
from expertcache.trace.format import RoutingTrace
from expertcache.serve.broker import sorted_ids
from expertcache.serve.control import ConfigError, check_fields, check_number, routing_from

__all__ = ["replay_frames", "parse_replay", "replay_json", "list_traces", "shipped_traces", "load_regular_trace",
           "public_message", "MAX_REPLAY_STEPS"]

MAX_REPLAY_STEPS = 2048


def shipped_traces() -> dict[str, Path]:
    d = Path(__file__).resolve().parent.parent / "assets" / "traces"
    return {p.name: p for p in sorted(d.glob("*.trace.safetensors"))}


def list_traces(trace_dirs) -> dict[str, Path]:
    """The shipped traces and ``trace_dirs``' ``*.trace.safetensors`` regular files (not a FIFO, device or
    folder of that name: reading one would block), each by its resolved path; a symbolic link that leads out of
    its folder is not listed (the folder is what the operator shared, not what a link in it points to)."""
    out = shipped_traces()
    for d in trace_dirs:
        try:
            root = Path(d).resolve()
        except (OSError, RuntimeError):
            continue
        for p in sorted(Path(d).glob("*.trace.safetensors")):
            try:
                real = p.resolve(strict=True)
            except (OSError, RuntimeError):  # dangling, or a loop of links
                continue
            if real.is_relative_to(root) and real.is_file():
                out.setdefault(p.name, real)
    return out


def public_message(text: str, paths) -> str:
    """``text`` (an error message for a client) with each of ``paths`` (the server's files and folders) written
    as its name only: a client learns nothing of the server's file system."""
    names = {}
    for p in paths:
        for x in (Path(p), Path(p).resolve()):
            names[str(x)] = x.name
    for full in sorted(names, key=len, reverse=True):
        if len(full) > 1:
            text = text.replace(full, names[full])
    return text


def load_regular_trace(path: Path):
    """:meth:`RoutingTrace.load`, after checking (opened non-blocking, so a FIFO cannot block the check, and
    without following a final symbolic link) that ``path`` is a regular file: OSError naming it otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
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



def replay_frames(trace, routing: RoutingConfig, capacity: int, *, eviction: str = "lru", gamma: float = DEFAULT_GAMMA,
                  start: int = 0, steps: int = 256) -> dict:
    """Tokens ``start .. start+steps`` of ``trace`` under ``routing`` / ``eviction`` / ``capacity`` through
    :func:`expertcache.sim.simulate` (one sequence, caches carried, empty at ``start``), then the served
    selections stepped through one fresh cache per layer to get per-step frames (same schema as the live
    ones). ``result`` holds the simulator's per-layer counts: the frames add up to them."""
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
                               evicted=sorted_ids(before - after),
                               prefetched=[], resident=sorted_ids(after)))
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
    check_fields(body, {"trace", "capacity", "eviction", "gamma", "start", "steps"}, "a replay takes")
    traces = list_traces(trace_dirs)
    name = body.get("trace")
    if not isinstance(name, str) or name not in traces:
        raise ConfigError("trace", f"unknown trace {json.dumps(name)[:80]}; available: {sorted(traces)}")
    cfg = routing_from(body, {})
    eviction = body.get("eviction", "lru")
    if not isinstance(eviction, str) or eviction not in EVICTIONS:
        raise ConfigError("eviction", f"must be one of {', '.join(EVICTIONS)}, got {json.dumps(eviction)[:40]}")
    if eviction_rule(eviction).offline and cfg.cache_aware:
        raise ConfigError("eviction", "belady needs fixed selections: only with policy original or prune")
    out = dict(routing=cfg, eviction=eviction)
    for k, default, integer in (("capacity", 8, True), ("gamma", DEFAULT_GAMMA, False), ("start", 0, True), ("steps", 256, True)):
        v = body.get(k, default)
        check_number(k, v, integer)
        out[k] = v
    if not 0 < out["gamma"] <= 1:
        raise ConfigError("gamma", f"must be in (0, 1], got {out['gamma']}")
    if not 1 <= out["steps"] <= MAX_REPLAY_STEPS:
        raise ConfigError("steps", f"must be in [1, {MAX_REPLAY_STEPS}], got {out['steps']}")
    return traces[name], out
