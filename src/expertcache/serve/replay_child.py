"""The replay child process (:class:`ReplayWorker` in the server, :func:`replay_worker_main` in the child): replays
run there, one at a time, JSON over pipes both ways (nothing unpickled)."""

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from expertcache.cache import eviction_rule
from expertcache.jsonsafe import loads
from expertcache.routing import RoutingConfig
from expertcache.serve.control import ConfigError
from expertcache.serve.replay import load_regular_trace, replay_json

__all__ = ["ReplayWorker", "ReplayTimeout", "replay_worker_main", "replay_worker", "REPLAY_TIMEOUT_S"]


#: seconds one replay may take in the child (a 2,048-step replay takes a few); then the child is killed and
#: replaced on the next replay, and the request gets 503
REPLAY_TIMEOUT_S = 60.0


class ReplayTimeout(OSError):
    """The replay child did not answer within its time limit (it was killed; the next replay starts another)."""


class ReplayWorker:
    """Replays in a child process (``python -c ...replay_worker_main()``, one request at a time over pipes, JSON
    both ways: nothing unpickled). A replay is seconds of Python (the simulator, then ~1.5 MB of JSON for 2,048
    steps); in a thread of the server it holds the GIL against the engine thread and the event loop (a running
    stream waited 1.3 s behind four replays), in its own process it only takes a core. Started on first use,
    restarted if it died; killed when a replay takes longer than ``timeout_s`` (a hung child, stopped or looping,
    is replaced, not waited for); :meth:`shutdown` kills it and refuses further replays (a server stopping does
    not wait on it). A policy or eviction the child does not know (registered in this process at run time)
    makes :meth:`run` return None: the caller replays in a thread instead."""

    def __init__(self, timeout_s: float = REPLAY_TIMEOUT_S) -> None:
        self.proc = None
        self.lock = threading.Lock()
        self.timeout_s = timeout_s
        self.stopping = False

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", "from expertcache.serve.replay_child import "
                                      "replay_worker_main; replay_worker_main()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        return self.proc

    def close(self) -> None:
        """Kill the child (a replay waiting on it gets OSError); the next replay starts another. Any thread."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def shutdown(self) -> None:
        """Kill the child and refuse further replays (OSError)."""
        self.stopping = True
        self.close()

    @staticmethod
    def _read(proc: subprocess.Popen, deadline: float) -> tuple[bytes, bytes]:
        """The child's answer (kind, body) read before ``deadline`` (ReplayTimeout), EOFError if it died."""
        fd = proc.stdout.fileno()
        buf = bytearray()
        need = None  # the answer's whole length, once its header line is in
        while need is None or len(buf) < need:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise ReplayTimeout("the replay took longer than its time limit")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            buf += chunk
            if need is None and b"\n" in buf:
                head = bytes(buf[:buf.index(b"\n")])
                kind, n = head.split()
                need = len(head) + 1 + int(n)
        head_len = buf.index(b"\n") + 1
        return kind, bytes(buf[head_len:need])

    def run(self, path: Path, opts: dict) -> bytes | None:
        """Blocking (call it from a worker thread): the replay's JSON bytes, None (see the class), or the
        child's :class:`ConfigError` / ``ValueError`` re-raised; OSError if the child died twice,
        :class:`ReplayTimeout` if it took longer than ``timeout_s`` (it is killed)."""
        req = json.dumps(dict(path=str(path), routing=opts["routing"].to_dict(),
                              **{k: opts[k] for k in ("capacity", "eviction", "gamma", "start", "steps")}))
        with self.lock:
            for attempt in range(2):
                if self.stopping:
                    raise OSError("the server is shutting down")
                proc = self.proc
                if proc is None or proc.poll() is not None:
                    proc = self._start()
                try:
                    proc.stdin.write(req.encode() + b"\n")
                    proc.stdin.flush()
                    kind, body = self._read(proc, time.monotonic() + self.timeout_s)
                except ReplayTimeout:
                    self.close()
                    raise ReplayTimeout(f"the replay took longer than {self.timeout_s:g} s; its process was "
                                        "replaced") from None
                except (OSError, ValueError, EOFError):
                    self.close()
                    if attempt or self.stopping:
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


#: a replay child for callers outside a server (each app's live view has its own)
replay_worker = ReplayWorker()
