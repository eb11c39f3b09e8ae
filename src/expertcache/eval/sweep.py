"""Sweeps over policy × strength × cache size × eviction, as resumable JSONL rows.

Two modes:

- **open loop** (:func:`open_loop_row`): the simulator re-routes a recorded trace (fast; the logits are
  fixed, so choices do not feed back). Its quality is a proxy, ``router_mass``: the router probability mass
  of the experts served divided by that of the router's own top-K, averaged over tokens and layers (1.0 for
  the original routing; lower when a policy swaps high-probability experts for resident ones);
- **closed loop**: :func:`expertcache.eval.runner.evaluate` on a model and task (real quality).

Every planned run has a *config key* (:func:`config_key`: a hash of the canonical JSON of what identifies
the run: mode, source, routing, cache). Rows carry it as ``sweep_key``; :func:`run_sweep` skips planned
runs whose key is already in the output file, so an interrupted sweep resumes where it stopped (rows are
appended atomically, one whole line each, by :func:`expertcache.results.append_jsonl`).

Grids (001 Sec. 4.2): prune h ∈ {1..K}; Max-Rank M ∈ {K..E} (M ≤ K promotes nothing, i.e. equals the
original routing, so 001's "0..K" would be degenerate under its own definition of M); cumsum p,
Cache-Prior λ and ERAS α at ``points`` equidistant values in [0, 1]; ERAS β in [0, ``beta_max``].
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from expertcache import __version__
from expertcache.cache import DEFAULT_GAMMA, eviction_rule, resolve_capacity
from expertcache.routing import RoutingConfig
from expertcache.routing.config import CACHE_PRIOR, STRENGTH
from expertcache.routing.registry import STRENGTH_RANGES, spec

__all__ = ["policy_grid", "plan", "config_key", "done_keys", "drop_torn_tail", "pending_runs", "sweep_row", "run_sweep",
           "open_loop_row", "closed_loop_row", "router_mass", "sweep_lock", "SweepLockedError"]


class SweepLockedError(RuntimeError):
    """Another process is appending to the same sweep output file."""


_HELD_LOCKS: dict[str, int] = {}  # resolved output path -> fd of its held lock file (this process)


@contextlib.contextmanager
def sweep_lock(out: str | Path):
    """Hold an exclusive, non-blocking ``flock`` on ``<out>.lock`` for the duration: a second sweep (another
    process) appending to the same file would duplicate rows, so it fails at once with SweepLockedError naming
    the file. Re-entrant within one process. The lock file is left in place (removing it would race). An output
    that is not a regular file (``/dev/null``, ``/dev/stdout``) takes no lock: nothing may be created beside it.
    A name at the file system's limit gets a shortened lock name (with a digest of the full name)."""
    import fcntl
    import hashlib

    from expertcache.outputs import name_max

    out = Path(out)
    if out.exists() and not out.is_file():
        yield
        return
    real = out.resolve()  # two names of one file (a symlink, a relative path) share one lock
    key = str(real)
    if key in _HELD_LOCKS:
        yield
        return
    lock = real.with_name(real.name + ".lock")
    if len(os.fsencode(lock.name)) > name_max(real.parent):
        short = real.name[:100]
        lock = real.with_name(f".{short}.{hashlib.sha256(os.fsencode(real.name)).hexdigest()[:16]}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SweepLockedError(f"{out} is being written by another sweep (lock {lock} is held); wait for it to "
                               "finish or give another --out") from None
    _HELD_LOCKS[key] = fd
    try:
        yield
    finally:
        del _HELD_LOCKS[key]
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def policy_grid(policy: str, *, k: int, num_experts: int, points: int = 50, top_j: int | None = None,
                beta_max: float = 4.0, strengths: Iterable[float] | None = None,
                delta: float | None = None) -> list[RoutingConfig]:
    """The routing configs of one policy's sweep (see the module docstring for the grids). ``strengths``
    replaces the continuous grid (p, λ, α, β). ``top_j`` None = each policy's default (``DEFAULT_TOP_J``)."""
    if points < 1:
        raise ValueError(f"points (--grid) must be ≥ 1, got {points}")
    spec(policy)  # ValueError for an unregistered name, listing the registered ones
    unit = [float(x) for x in strengths] if strengths is not None else \
        [round(float(x), 6) for x in np.linspace(0.0, 1.0, points)]
    name = STRENGTH[policy]  # the grid follows the policy's strength parameter, never a neighbour's branch
    delta_kw = {"delta": delta} if policy in CACHE_PRIOR else {}
    if name is None:
        return [RoutingConfig(policy)]
    if name == "h":
        return [RoutingConfig(policy, h=h) for h in range(1, k + 1)]
    if name == "m":
        return [RoutingConfig(policy, m=m, top_j=top_j) for m in range(k, num_experts + 1)]
    if name == "beta":
        values = unit if strengths is not None else [round(beta_max * x, 6) for x in unit]
    elif name in STRENGTH_RANGES:  # p, λ, α: the unit grid
        values = unit
    else:
        raise ValueError(f"no sweep grid for {policy!r}'s strength {name!r}")
    return [RoutingConfig(policy, top_j=top_j, **{name: x}, **delta_kw) for x in values]


def plan(*, mode: str, source: dict[str, Any], policies: Iterable[str], k: int, num_experts: int,
         capacities: Iterable[str | int | float], evictions: Iterable[str], points: int = 50,
         top_j: int | None = None,
         beta_max: float = 4.0, strengths=None, delta=None, gamma: float = DEFAULT_GAMMA, initial: str = "empty",
         seed: int = 0, between_sequences: str = "carry", scope: str | None = None) -> list[dict[str, Any]]:
    """Every run of the sweep as a JSON-able dict (its identity; see :func:`config_key`), capacity-major.
    Belady eviction is planned only for fixed selections (original, prune); in closed loop never (every
    closed-loop row reports ``belady_miss_rate`` anyway)."""
    caps = dict.fromkeys(resolve_capacity(c, num_experts) for c in capacities)  # distinct, in order
    out = []
    for cap in caps:
        for ev in evictions:
            for pol in policies:
                if eviction_rule(ev).offline and (mode == "closed-loop" or spec(pol).code is not None):
                    continue  # an offline rule (Belady) needs fixed selections
                for rc in policy_grid(pol, k=k, num_experts=num_experts, points=points, top_j=None if top_j is None else min(top_j, k),
                                      beta_max=beta_max, strengths=strengths, delta=delta):
                    out.append(dict(mode=mode, source=source, routing=rc.to_dict(), eviction=ev, capacity=cap,
                                    gamma=eviction_rule(ev).settings(gamma=gamma).get("gamma"),
                                    initial=initial, seed=seed,
                                    between_sequences=between_sequences, scope=scope))
    return out


def config_key(run: dict[str, Any]) -> str:
    """A stable key of one planned run (sha1 of its canonical JSON, 16 hex digits)."""
    return hashlib.sha1(json.dumps(run, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def done_keys(path: str | Path) -> set[str]:
    """Config keys of the rows already in ``path`` (empty if it does not exist or is not a regular file: a stream
    such as ``/dev/stdout`` is never read back -- reading a pipe's other end would block)."""
    from expertcache.results import read_jsonl

    path = Path(path)
    if not path.is_file():
        return set()
    return {r["sweep_key"] for r in read_jsonl(path) if "sweep_key" in r}


def drop_torn_tail(path: str | Path) -> bool:
    """Cut an unterminated last line (a row torn by an interrupted write) off ``path`` so that appended rows
    start on a fresh line; returns whether anything was cut. The torn run is simply run again."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return False
        f.truncate(data.rfind(b"\n") + 1)
    return True


def pending_runs(runs: list[dict[str, Any]], out: str | Path) -> list[dict[str, Any]]:
    """The runs whose config key is not yet in ``out`` (each key once), after cutting a torn last line off it
    (:func:`drop_torn_tail`) -- only when ``out`` is a row file (:func:`expertcache.outputs.check_row_file`:
    a text file or a trace is refused untouched). Call it holding :func:`sweep_lock`."""
    from expertcache.outputs import check_row_file

    check_row_file(out, "--out")
    drop_torn_tail(out)
    done = done_keys(out)
    todo = {k: r for r in runs if (k := config_key(r)) not in done}
    return list(todo.values())


def sweep_row(row: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """``row`` (what executing ``run`` returned) with the sweep's identity: ``sweep_key``, ``sweep``, ``version``,
    ``seed``."""
    row.update(sweep_key=config_key(run), sweep=run, version=__version__, seed=run["seed"])
    return row


def run_sweep(runs: list[dict[str, Any]], out: str | Path, execute: Callable[[dict[str, Any]], dict[str, Any]],
              *, progress: bool = False) -> tuple[int, int]:
    """Execute the runs whose key is not yet in ``out``, appending one row each (:func:`sweep_row`); returns
    (executed, skipped)."""
    from tqdm import tqdm

    from expertcache.results import append_jsonl

    with sweep_lock(out):
        todo = pending_runs(runs, out)
        written = 0
        for run in tqdm(todo, desc="sweep", unit="run", disable=not progress):
            row = sweep_row(execute(run), run)
            try:
                append_jsonl(out, row)  # whole or absent
            except OSError as exc:  # e.g. a full disk: say how many rows the file did get
                raise OSError(exc.errno, f"{exc.strerror} ({written} of {len(todo)} runs appended before; re-run "
                                         "to resume)", exc.filename) from None
            written += 1
    return written, len(runs) - len(todo)


def router_mass(logits_TLE: np.ndarray, served_TLK: np.ndarray, k: int, scoring: str = "softmax") -> float:
    """Open-loop quality proxy: mean over tokens and layers of (router probability of the served experts) /
    (probability of the router's top-K). Probabilities: softmax over all E (sigmoid for sigmoid routers);
    dropped slots (-1) count 0."""
    z = np.asarray(logits_TLE, dtype=np.float32)
    if scoring == "sigmoid":
        p = 1.0 / (1.0 + np.exp(-z))
    else:
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
    ids = np.asarray(served_TLK).astype(np.int64)
    served = np.where(ids >= 0, np.take_along_axis(p, np.clip(ids, 0, None), axis=-1), 0.0).sum(-1)
    top = -np.partition(-p, k - 1, axis=-1)[..., :k]
    return float((served / top.sum(-1)).mean()) if served.size else float("nan")


def _gamma(run: dict[str, Any]) -> float:
    """γ of a planned run: its own value where its eviction rule reads one (0 included), else make_cache's
    default (unused by the rule)."""
    return DEFAULT_GAMMA if run.get("gamma") is None else float(run["gamma"])


def closed_loop_row(model, task, run: dict[str, Any], *, freq_LE=None, model_name: str = "") -> dict[str, Any]:
    """Evaluate one planned closed-loop run (:func:`expertcache.eval.evaluate`'s row)."""
    from expertcache.eval import evaluate

    return evaluate(model, task, RoutingConfig.from_dict(run["routing"]), eviction=run["eviction"],
                    capacity=run["capacity"], gamma=_gamma(run), initial=run["initial"], seed=run["seed"],
                    between_sequences=run["between_sequences"], scope=run["scope"], freq_LE=freq_LE,
                    model_name=model_name)


def open_loop_row(trace, run: dict[str, Any], *, freq_LE=None) -> dict[str, Any]:
    """Simulate one planned run on ``trace``; the simulator's row plus the quality proxy and Belady bound."""
    from expertcache.sim import simulate

    t0 = time.perf_counter()
    rc = RoutingConfig.from_dict(run["routing"])
    res = simulate(trace, rc, run["capacity"], eviction=run["eviction"], gamma=_gamma(run),
                   initial=None if run["initial"] == "empty" else run["initial"], seed=run["seed"],
                   belady=not eviction_rule(run["eviction"]).offline, freq_LE=freq_LE,
                   between_sequences=run["between_sequences"])
    row = res.to_row()
    if eviction_rule(run["eviction"]).offline:
        row["belady_miss_rate"] = row["miss_rate"]
    row["config"]["trace"] = run["source"].get("trace")
    row.update(kind="sweep", mode="open-loop", quality_name="router_mass",
               quality=router_mass(trace.logits_TLE, res.ids_TLK, trace.meta.top_k, trace.meta.scoring),
               higher_is_better=True, seconds=time.perf_counter() - t0)
    return row
