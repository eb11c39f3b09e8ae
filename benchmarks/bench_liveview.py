#!/usr/bin/env python
"""Does watching slow decoding? Decode tok/s of one greedy request (``--tokens`` tokens, ``ignore_eos``) on the
shipped model with no live-view subscriber, with one that reads every frame, and with one that never reads a
byte (a TCP connection to /v1/expertcache/events left unread). The three modes are interleaved, ``--runs``
times each; medians reported (the VM is shared and noisy: compare within one run of this script).

  OMP_NUM_THREADS=1 python benchmarks/bench_liveview.py --runs 9 --tokens 64 --out benchmarks/results/liveview.jsonl

Decode tok/s = (tokens - 1) / (client wall time - time to first token). Loopback only; the server runs in
this process (a thread) and is stopped at the end. Prints a table; ``--out`` appends one JSONL row per mode
(every run's tok/s, the median, the configuration, package version and machine).
"""

from __future__ import annotations

import argparse
import platform
import socket
import statistics
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=8)
    ap.add_argument("--out", default=None, help="append one JSONL row per mode to this file")
    a = ap.parse_args()
    from expertcache.results import check_rows_out

    check_rows_out(ap, a.out)  # rows go to a row file only: never appended to notes.md
    if a.runs < 1 or a.tokens < 2:
        ap.error("--runs must be >= 1 and --tokens >= 2")
    import httpx
    import torch

    torch.set_num_threads(1)
    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.offload.runtime import resolve_model_path
    from expertcache.serve.app import create_app
    from expertcache.serve.engine import Engine
    from expertcache.serve.server import ServerThread
    from expertcache.train.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path("granular"))
    rt = OffloadedModel.from_pretrained("granular", OffloadConfig(io="cached", capacity=a.capacity))
    eng = Engine(rt, tok).start()
    srv = ServerThread(create_app(eng, "granular", tokenizer=tok)).start()
    u = srv.url

    def one() -> float:
        t = time.perf_counter()
        r = httpx.post(u + "/v1/completions", json=dict(model="granular", prompt="In 1990 the city of",
                       max_tokens=a.tokens, temperature=0, ignore_eos=True), timeout=300).json()
        return (a.tokens - 1) / (time.perf_counter() - t - r["expertcache"]["ttft_s"])

    def reader(stop: threading.Event) -> None:
        with httpx.stream("GET", u + "/v1/expertcache/events", timeout=300) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    res: dict[str, list[float]] = {"no subscriber": [], "one reading": [], "one never reading": []}
    one()  # warm-up
    try:
        for _ in range(a.runs):
            for mode in res:
                stop, sock = threading.Event(), None
                if mode == "one reading":
                    threading.Thread(target=reader, args=(stop,), daemon=True).start()
                elif mode == "one never reading":
                    sock = socket.create_connection(("127.0.0.1", srv.port))
                    sock.sendall(b"GET /v1/expertcache/events HTTP/1.1\r\nHost: x\r\n\r\n")
                time.sleep(0.3)
                res[mode].append(one())
                stop.set()
                if sock is not None:
                    sock.close()
                time.sleep(0.3)
    finally:
        srv.stop()
        eng.shutdown(0)
    print(f"# granular, C={a.capacity}, {a.tokens} tokens greedy, {a.runs} interleaved runs, "
          f"{platform.machine()} {platform.processor() or ''}, torch threads 1")
    print("| live-view subscribers | median decode tok/s | min – max |")
    print("|---|---:|---:|")
    for k, v in res.items():
        print(f"| {k} | {statistics.median(v):.1f} | {min(v):.1f} – {max(v):.1f} |")
    if a.out:
        from expertcache import __version__
        from expertcache.offload.bench import machine_info
        from expertcache.results import append_jsonl

        for k, v in res.items():
            append_jsonl(a.out, dict(bench="liveview", mode=k, model="granular", capacity=a.capacity, io="cached",
                                     tokens=a.tokens, runs=a.runs, tok_s_runs=v, median_tok_s=statistics.median(v),
                                     version=__version__, machine=machine_info(),
                                     date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))


if __name__ == "__main__":
    main()
