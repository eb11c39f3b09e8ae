#!/usr/bin/env python
"""`expertcache serve` under hostile and careless clients (issue 33): the largest token gap of a running stream
while each attack runs, against the same stream with no attack (interleaved), and what the attackers got.

One server (`expertcache serve` in a subprocess on 127.0.0.1, an ephemeral port, RLIMIT_NOFILE ``--nofile``
so that 1,100 connections exceed its file descriptors, a ``--trace-dir`` holding a FIFO named like a trace).
Per repeat and attack: a greedy streamed completion of ``--tokens`` tokens (``ignore_eos``) starts; after its
first token the attack starts in a thread; the stream's largest gap between two token chunks is recorded, and
/health is probed every 0.2 s meanwhile (its slowest answer). The baseline is the same stream with no attack,
run before every attack. The server's log growth over the whole run is reported too.

Attacks: ``half_open`` (1,100 connections each sending half a request head, held 6 s), ``chunked_replay``
(a chunked 50 MB body to /v1/expertcache/replay), ``replay_x4`` (4 parallel 2,048-step replays),
``events_200`` (200 connections to /v1/expertcache/events that never read), ``fifo`` (a replay of the FIFO),
``deep_json`` (10 bodies nested 200,000 deep), ``gone_mid_body`` (200 clients that send half a body and close),
``top_p_tiny`` (a request with temperature 0.7 and top_p 1e-300, then one more request), ``trickle_bodies``
(issue 43: 1,100 connections that send a head, then their body a byte every 0.5 s, each re-opened as soon as the
server closes it, for 8 s), ``header_flood`` (issue 43: 4 clients each sending heads of 10,000 headers, 116 kB
in one write, for 6 s).

  python benchmarks/bench_serve_hostile.py --repeats 3 --out benchmarks/results/serve-hostile.jsonl

Loopback only; every count is bounded; the server is stopped with SIGTERM (killed if it hangs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from expertcache.results import append_jsonl  # rows whole or absent, to row files only

HOST = "127.0.0.1"


def start(nofile: int, trace_dir: str, log_path: str):
    cmd = [sys.executable, "-m", "expertcache.cli.main", "serve", "--host", HOST, "--port", "0", "--io", "cached",
           "--cache-experts", "8", "--threads", "1", "--trace-dir", trace_dir]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("EXPERTCACHE_API_KEY", None)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stderr=log, stdout=subprocess.DEVNULL, env=env,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 180:
        text = open(log_path).read()
        m = re.search(r" on (http://\S+)/v1", text)
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not start: {open(log_path).read()[-2000:]}")


def stream_gaps(url: str, tokens: int, started: threading.Event) -> dict:
    """A streamed greedy completion: its largest gap between token chunks after the first (seconds)."""
    body = {"model": "granular", "prompt": "The history of the city", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if len(times) == 2:
                    started.set()
    started.set()
    gaps = np.diff(times[1:]) if len(times) > 2 else np.array([0.0])
    return dict(max_gap_s=float(gaps.max()), p50_gap_s=float(np.median(gaps)), chunks=len(times))


def half_open_sockets(port: int, n: int) -> list[socket.socket]:
    """``n`` connections to 127.0.0.1:``port``, each having sent half a request head (never finished)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect((HOST, port))
        except BlockingIOError:
            pass
        socks.append(s)
    time.sleep(0.1)
    for s in socks:
        try:
            s.send(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
        except OSError:
            pass
    return socks


def half_open(url: str, n: int = 1100, hold: float = 6.0) -> dict:
    socks = half_open_sockets(int(url.rsplit(":", 1)[1]), n)
    time.sleep(hold)
    closed = 0
    for s in socks:
        try:
            s.setblocking(True)
            s.settimeout(0.001)
            closed += s.recv(1) == b""
        except OSError:
            pass
        s.close()
    return dict(connections=n, closed_by_server=closed)


def chunked_replay(url: str, mb: int = 50) -> dict:
    def gen():
        yield b'{"trace": "'
        for _ in range(mb * 16):
            yield b"x" * (1 << 16)
        yield b'"}'
    try:
        r = httpx.post(url + "/v1/expertcache/replay", content=gen(), headers={"Content-Type": "application/json"},
                       timeout=120)
        return dict(status=r.status_code)
    except httpx.HTTPError as exc:  # the server answered 413 and closed while we were still sending
        return dict(status=f"closed ({type(exc).__name__})")


def replay_x4(url: str) -> dict:
    out = []

    def one():
        r = httpx.post(url + "/v1/expertcache/replay", timeout=120, json={
            "trace": "granular-wikitext2.trace.safetensors", "policy": "cache-prior", "lam": 0.5, "capacity": 8,
            "steps": 2048})
        out.append((r.status_code, len(r.content)))
    ts = [threading.Thread(target=one) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    return dict(statuses=sorted(s for s, _ in out), bytes=max((n for _, n in out), default=0))


def events_200(url: str, n: int = 200, hold: float = 6.0) -> dict:
    port = int(url.rsplit(":", 1)[1])
    socks = []
    for _ in range(n):
        s = socket.create_connection((HOST, port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"GET /v1/expertcache/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        socks.append(s)
    time.sleep(hold)
    refused = 0
    for s in socks:
        try:
            s.settimeout(0.01)
            refused += s.recv(12).startswith(b"HTTP/1.1 429")
        except OSError:
            pass
        s.close()
    return dict(connections=n, refused_429=refused)


def fifo(url: str) -> dict:
    r = httpx.post(url + "/v1/expertcache/replay", json={"trace": "stuck.trace.safetensors"}, timeout=60)
    return dict(status=r.status_code)


def deep_json(url: str) -> dict:
    raw = b"[" * 200_000 + b"]" * 200_000
    st = [httpx.post(url + p, content=raw, headers={"Content-Type": "application/json"}, timeout=60).status_code
          for p in ("/v1/completions", "/v1/expertcache/config") * 5]
    return dict(statuses=sorted(set(st)))


def gone_mid_body(url: str, n: int = 200) -> dict:
    port = int(url.rsplit(":", 1)[1])
    for _ in range(n):
        s = socket.create_connection((HOST, port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\"")
        s.close()
    time.sleep(0.5)
    m = httpx.get(url + "/metrics", timeout=30).text
    counts = {st: sum(float(x) for x in re.findall(rf'expertcache_requests_total\{{route="/v1/completions",status="{st}"\}} (\S+)', m))
              for st in ("499", "500")}
    return dict(clients=n, **{f"count_{k}": v for k, v in counts.items()})


def top_p_tiny(url: str) -> dict:
    r1 = httpx.post(url + "/v1/completions", timeout=60, json={"model": "granular", "prompt": "The", "max_tokens": 4,
                                                              "temperature": 0.7, "top_p": 1e-300})
    r2 = httpx.post(url + "/v1/completions", timeout=60, json={"model": "granular", "prompt": "The", "max_tokens": 4})
    return dict(statuses=[r1.status_code, r2.status_code])


BODY_HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: 4000\r\n\r\n{")


def _open_trickler(port: int):
    try:
        s = socket.create_connection((HOST, port), timeout=2)
        s.setblocking(False)
        s.send(BODY_HEAD)
        return s
    except OSError:
        return None


def trickle_bodies(url: str, n: int = 1100, hold: float = 8.0, every: float = 0.5) -> dict:
    """``n`` connections trickling their bodies (a byte per ``every`` s per connection), each re-opened when
    the server closes it; what the server answered them (by status line) and how often they were re-opened."""
    port = int(url.rsplit(":", 1)[1])
    socks = [_open_trickler(port) for _ in range(n)]
    answers: dict = {}
    reopened = 0
    t_end = time.monotonic() + hold
    while time.monotonic() < t_end:
        t0 = time.monotonic()
        for i, s in enumerate(socks):
            try:
                if s is None:
                    raise OSError
                try:
                    got = s.recv(4096)
                    key = got[:12].decode("latin-1") or "closed"
                    answers[key] = answers.get(key, 0) + 1
                    raise OSError  # answered or closed: the server is done with it
                except BlockingIOError:
                    pass
                s.send(b" ")
            except OSError:
                if s is not None:
                    s.close()
                socks[i] = _open_trickler(port)
                reopened += 1
        time.sleep(max(0.0, every - (time.monotonic() - t0)))
    for s in socks:
        if s is not None:
            s.close()
    return dict(connections=n, reopened=reopened, answers=answers)


def header_flood(url: str, clients: int = 4, hold: float = 6.0) -> dict:
    port = int(url.rsplit(":", 1)[1])
    head = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + b"".join(b"X-%d: xxxxxx\r\n" % i for i in range(10_000)) + b"\r\n")
    out: list = []

    def client():
        t_end = time.monotonic() + hold
        while time.monotonic() < t_end:
            t0 = time.perf_counter()
            try:
                s = socket.create_connection((HOST, port), timeout=10)
                s.sendall(head)
                got = s.recv(12)
                s.close()
            except OSError as exc:
                got = type(exc).__name__.encode()
            out.append((got.decode("latin-1"), time.perf_counter() - t0))

    ts = [threading.Thread(target=client) for _ in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(hold + 60)
    statuses = sorted({s for s, _ in out})
    return dict(requests=len(out), statuses=statuses, slowest_s=round(max((t for _, t in out), default=0), 4))


ATTACKS = dict(half_open=half_open, chunked_replay=chunked_replay, replay_x4=replay_x4, events_200=events_200,
               fifo=fifo, deep_json=deep_json, gone_mid_body=gone_mid_body, top_p_tiny=top_p_tiny,
               trickle_bodies=trickle_bodies, header_flood=header_flood)


def run_one(url: str, tokens: int, attack) -> dict:
    started, done = threading.Event(), threading.Event()
    res, health = {}, []

    def probe():
        while not done.is_set():
            t0 = time.perf_counter()
            try:
                ok = httpx.get(url + "/health", timeout=10).status_code == 200
            except httpx.HTTPError:
                ok = False
            health.append((time.perf_counter() - t0, ok))
            time.sleep(0.2)

    def attacker():
        started.wait(60)
        t0 = time.perf_counter()
        res["attack"] = attack(url)
        res["attack_s"] = round(time.perf_counter() - t0, 3)

    pt = threading.Thread(target=probe, daemon=True)
    at = threading.Thread(target=attacker) if attack else None
    pt.start()
    if at:
        at.start()
    res.update(stream_gaps(url, tokens, started))
    if at:
        at.join(600)
    done.set()
    pt.join(30)
    res["health_max_s"] = round(max(h for h, _ in health), 3) if health else None
    res["health_failed"] = sum(not ok for _, ok in health)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=list(ATTACKS))
    ap.add_argument("--tokens", type=int, default=200, help="tokens of the running stream (default 200)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nofile", type=int, default=1024, help="the server's RLIMIT_NOFILE (default 1024)")
    ap.add_argument("--out", default=None, help="append JSONL rows here")
    a = ap.parse_args(argv)
    from expertcache.results import check_rows_out

    check_rows_out(ap, a.out)  # rows go to a row file only: never appended to notes.md
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this client holds 1,100+ sockets
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory() as d:
        os.mkfifo(Path(d) / "stuck.trace.safetensors")
        log = str(Path(d) / "server.log")
        proc, url = start(a.nofile, d, log)
        try:
            run_one(url, 16, None)  # warm-up
            rows = []
            for rep in range(a.repeats):
                for name in a.attacks:
                    base = run_one(url, a.tokens, None)
                    log0 = os.path.getsize(log)
                    hit = run_one(url, a.tokens, ATTACKS[name])
                    row = dict(attack=name, repeat=rep, baseline_max_gap_s=round(base["max_gap_s"], 4),
                               max_gap_s=round(hit["max_gap_s"], 4), p50_gap_s=round(hit["p50_gap_s"], 4),
                               health_max_s=hit["health_max_s"], health_failed=hit["health_failed"],
                               log_bytes=os.path.getsize(log) - log0, attack_s=hit.get("attack_s"),
                               result=hit.get("attack"), alive=proc.poll() is None)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            machine = dict(host=platform.node(), cpus=os.cpu_count(), load1=round(os.getloadavg()[0], 2),
                           tokens=a.tokens, nofile=a.nofile)
            summary = {}
            for name in a.attacks:
                rs = [r for r in rows if r["attack"] == name]
                summary[name] = dict(max_gap_s_median=float(np.median([r["max_gap_s"] for r in rs])),
                                     max_gap_s_worst=max(r["max_gap_s"] for r in rs),
                                     baseline_max_gap_s_median=float(np.median([r["baseline_max_gap_s"] for r in rs])),
                                     health_max_s=max(r["health_max_s"] or 0 for r in rs),
                                     health_failed_max=max(r["health_failed"] for r in rs),
                                     log_bytes_max=max(r["log_bytes"] for r in rs))
            print(json.dumps(dict(summary=summary, machine=machine), indent=1))
            if a.out:
                for r in rows:
                    append_jsonl(a.out, dict(r, machine=machine, bench="serve-hostile"))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
