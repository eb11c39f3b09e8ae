"""Sweeps on Ray: the planned runs of :mod:`expertcache.eval.sweep` as Ray tasks, the JSONL written by the
driver alone.

:func:`run_sweep_ray` is :func:`expertcache.eval.sweep.run_sweep` with the ``execute`` calls moved into Ray tasks
(one CPU each): the driver holds the sweep's file lock, cuts a torn last line, skips the runs whose config key
is already in the file, submits the rest, and appends each row (with ``sweep_key``, ``sweep``, ``version``,
``seed``, exactly as ``run_sweep``) as its task finishes. Workers never touch the output file, so there are no
duplicate rows, and a killed sweep resumes like a single-process one (finished rows stay; runs in flight are run
again). Rows come in completion order; their content equals the single-process sweep's (timings aside).

What a worker needs travels in a *spec* (plain data, see :func:`open_loop_spec` / :func:`closed_loop_spec`):
open loop ships the trace file's bytes through the object store (no shared file system needed); closed loop
names a model and data folder, which must exist at the same path on every node. Each worker process builds
its executor once per spec (the trace or model is loaded once, not per run).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from expertcache import __version__

__all__ = ["open_loop_spec", "closed_loop_spec", "make_executor", "run_sweep_ray"]

_EXECUTORS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}  # per worker process: spec key -> execute


def open_loop_spec(trace_path: str | os.PathLike, *, need_freq: bool, threads: int = 1) -> dict[str, Any]:
    """A worker spec for open-loop runs on the trace at ``trace_path`` (its bytes travel with the spec)."""
    data = Path(trace_path).read_bytes()
    return dict(mode="open-loop", trace_bytes=data, trace_sha1=hashlib.sha1(data).hexdigest(),
                need_freq=bool(need_freq), threads=int(threads), version=__version__)


def closed_loop_spec(*, model: str, task: str, data_dir=None, limit=None, shots=None, max_new_tokens=256,
                     freq_LE=None, threads: int = 1) -> dict[str, Any]:
    """A worker spec for closed-loop runs (model and data folders must exist on every node)."""
    import numpy as np

    freq = None if freq_LE is None else np.asarray(freq_LE, dtype=np.float64).tolist()
    return dict(mode="closed-loop", model=str(model), task=task, data_dir=None if data_dir is None else str(data_dir),
                limit=limit, shots=shots, max_new_tokens=max_new_tokens, freq=freq, threads=int(threads),
                version=__version__)


def _spec_key(spec: dict[str, Any]) -> str:
    import json

    ident = {k: v for k, v in spec.items() if k != "trace_bytes"}
    return hashlib.sha1(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


def make_executor(spec: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The ``execute(run) -> row`` of a spec, built once per process and kept (the same rows as the
    single-process ``expertcache sweep``)."""
    key = _spec_key(spec)
    if key in _EXECUTORS:
        return _EXECUTORS[key]
    if spec.get("version") != __version__:
        raise RuntimeError(f"expertcache {__version__} on this Ray worker, {spec.get('version')} on the driver: "
                           "install the same version on every node")
    import numpy as np
    import torch

    from expertcache.eval.sweep import closed_loop_row, open_loop_row

    torch.set_num_threads(spec.get("threads", 1))
    if spec["mode"] == "open-loop":
        from expertcache.sim import activation_frequency
        from expertcache.trace import RoutingTrace, atomic_write_bytes

        path = Path(tempfile.gettempdir()) / "expertcache-ray" / f"{spec['trace_sha1']}.trace.safetensors"
        if not path.exists():
            atomic_write_bytes(path, spec["trace_bytes"])
        trace = RoutingTrace.load(path)
        freq = activation_frequency(trace.ids_TLK, trace.meta.num_experts) if spec["need_freq"] else None

        def execute(run):
            return open_loop_row(trace, run, freq_LE=freq)
    else:
        from expertcache.eval import prepare

        model, _, task = prepare(spec["model"], spec["task"], data_dir=spec["data_dir"], limit=spec["limit"],
                                 shots=spec["shots"], max_new_tokens=spec["max_new_tokens"])
        freq = None if spec["freq"] is None else np.asarray(spec["freq"], dtype=np.float32)

        def execute(run):
            return closed_loop_row(model, task, run, freq_LE=freq, model_name=spec["model"])
    _EXECUTORS[key] = execute
    return execute


def _execute_remote(spec: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    return make_executor(spec)(run)


def run_sweep_ray(runs: list[dict[str, Any]], out: str | os.PathLike, spec: dict[str, Any], *,
                  address: str | None = None, num_cpus: int | None = None, progress: bool = False) -> tuple[int, int]:
    """Execute the runs whose key is not yet in ``out`` as Ray tasks; the driver appends one row per finished
    task. ``address``: None or 'local' = a new local Ray instance (``num_cpus`` workers; default all CPUs),
    'auto' = the cluster this node belongs to, 'ray://HOST:10001' = Ray client, or any ``ray.init`` address.
    An already initialised Ray (``ray.init`` by the caller) is used as it is. Returns (executed, skipped)."""
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'expertcache[ray]'") from None
    from expertcache.eval.sweep import pending_runs, sweep_lock, sweep_row
    from expertcache.results import append_jsonl

    with sweep_lock(out):
        todo = pending_runs(runs, out)
        if not todo:
            return 0, len(runs)
        started = False
        if not ray.is_initialized():
            kw: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False)
            if address not in (None, "local"):
                kw["address"] = address
            elif num_cpus is not None:
                kw["num_cpus"] = num_cpus
            try:
                ray.init(**kw)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ValueError(f"--ray {address or 'local'}: cannot start or reach Ray ({exc})") from None
            started = True
        from tqdm import tqdm

        bar, pending = tqdm(total=len(todo), desc="sweep (ray)", unit="run", disable=not progress), {}
        try:
            task = ray.remote(num_cpus=1, max_retries=0)(_execute_remote)
            spec_ref = ray.put(spec)
            pending = {task.remote(spec_ref, r): r for r in todo}
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    append_jsonl(out, sweep_row(ray.get(ref), pending.pop(ref)))
                    bar.update(1)
        except BaseException:
            for ref in pending:  # a failed run or Ctrl-C: stop the rest (finished rows are in the file)
                ray.cancel(ref, force=True)
            raise
        finally:
            bar.close()
            if started:
                ray.shutdown()
        return len(todo), len(runs) - len(todo)
