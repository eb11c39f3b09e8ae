"""Running the app: uvicorn with a graceful SIGTERM/SIGINT (:func:`serve_forever`), or in a thread on an
ephemeral loopback port (:class:`ServerThread`, for tests and benchmarks)."""

from __future__ import annotations

import socket
import sys
import threading
import time

__all__ = ["serve_forever", "ServerThread", "bind", "tune_malloc"]


def tune_malloc(threshold: int = 1 << 16) -> bool:
    """glibc only: serve allocations of ``threshold`` bytes or more from mmap (``M_MMAP_THRESHOLD``), so the
    KV tensors a server keeps re-allocating (rows join and leave, every decode step grows the cache by
    ``torch.cat``) go back to the OS when freed instead of staying in the heap once glibc's dynamic threshold
    has risen. Measured in-process on the granular model (16 rows × 32 tokens per round): RSS 526 → 541 MiB
    then flat with it, 543 → 561 MiB and still rising without. The HTTP server's RSS still grows, sub-linearly
    (BENCHMARKS.md, serving section). True if applied."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(-3, int(threshold)))  # M_MMAP_THRESHOLD = -3
    except (OSError, AttributeError):
        return False


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket (port 0 = an ephemeral port; read it from ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _server(app, *, log_level: str, grace_s: float):
    """A uvicorn server for ``app`` that shuts down gracefully: on the first SIGTERM/SIGINT new requests get
    503 (the server keeps accepting connections to say so), waiting ones are cancelled, running ones get
    ``grace_s`` to finish (then are cancelled); once none is left uvicorn stops listening, waits for their
    connections, then returns normally (the signal is handled, not re-raised). A second signal stops at once."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            from expertcache.serve.app import begin_shutdown

            if app.state.shutting_down:  # the second signal: stop listening now
                super().handle_exit(sig, frame)
                self._captured_signals.clear()
                return
            n = begin_shutdown(app, grace_s)
            print(f"expertcache serve: shutting down: {app.state.engine.in_flight()} running request(s) get up "
                  f"to {grace_s:g} s to finish, {n} waiting request(s) cancelled (503)", file=sys.stderr,
                  flush=True)
            self._captured_signals.clear()
            threading.Thread(target=self._drain_then_exit, args=(sig, frame), daemon=True,
                             name="expertcache-drain").start()

        def _drain_then_exit(self, sig, frame) -> None:
            """Keep answering (503 for new requests) until the engine has nothing in flight, then let uvicorn
            stop (the engine cancels what is left after ``grace_s``; one more second for their last events)."""
            eng = app.state.engine
            deadline = time.monotonic() + grace_s + 1.0
            while (eng.in_flight() or eng.queue_length()) and time.monotonic() < deadline:
                time.sleep(0.02)
            uvicorn.Server.handle_exit(self, sig, frame)
            self._captured_signals.clear()

    return Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace_s + 5, lifespan="off",
                                 access_log=False, timeout_keep_alive=5))


def serve_forever(app, sock: socket.socket, *, grace_s: float = 30.0, log_level: str = "warning") -> None:
    _server(app, log_level=log_level, grace_s=grace_s).run(sockets=[sock])


class ServerThread:
    """uvicorn in a daemon thread on ``127.0.0.1:<ephemeral>``; :meth:`stop` shuts it down like SIGTERM."""

    def __init__(self, app, *, grace_s: float = 5.0, host: str = "127.0.0.1") -> None:
        self.app = app
        self.sock = bind(host, 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = _server(app, log_level="error", grace_s=grace_s)
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]), daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if time.monotonic() - t0 > timeout or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.handle_exit(15, None)
        self.thread.join(timeout)
        self.sock.close()
