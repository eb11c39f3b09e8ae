"""The replay child process (:class:`ReplayWorker` in the server, :func:`replay_worker_main` in the child): replays
run there, one at a time, JSON over pipes both ways (nothing unpickled)."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from expertcache.cache import eviction_rule
from expertcache.jsonsafe import loads
from expertcache.routing import RoutingConfig
from expertcache.serve.control import ConfigError
from expertcache.serve.replay import load_regular_trace, replay_json

__all__ = ["ReplayWorker", "replay_worker_main", "replay_worker"]


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
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", "from expertcache.serve.replay_child import "
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


#: the server's one replay child
replay_worker = ReplayWorker()
