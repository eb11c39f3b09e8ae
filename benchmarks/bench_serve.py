#!/usr/bin/env python
"""`expertcache serve` under load: aggregate tok/s, time to first token and inter-token latency at several
client concurrencies, per routing policy; and the server's RSS over many served tokens.

Each policy gets a fresh server (`expertcache serve` in a subprocess on 127.0.0.1, an ephemeral port). Clients
are threads of this process, each sending streamed completions one after another (closed loop), greedy,
``ignore_eos`` (every request generates exactly ``--tokens`` tokens). Per concurrency level c: c clients ×
``--rounds`` requests. Figures per level: generated tokens / wall time from the first send to the last
``[DONE]`` (aggregate tok/s), client-side TTFT (send → first token chunk) and inter-token latency (gaps between
token chunks) p50/p95, the expert-cache hit rate of the level's requests (their ``expertcache`` objects).

  python benchmarks/bench_serve.py --model granular --concurrency 1 4 16 32 --out benchmarks/results/serve.jsonl
  python benchmarks/bench_serve.py --model ~/.cache/expertcache/bench-models/olmoe-1b-7b-L4-e1 \\
      --concurrency 1 4 16 --tokens 16 --rounds 1 --out benchmarks/results/serve.jsonl
  python benchmarks/bench_serve.py --model granular --rss-tokens 10000 --out benchmarks/results/serve.jsonl
  python benchmarks/bench_serve.py --soak 600 --warmup 60 --clients 16 --out benchmarks/results/serve-soak.jsonl

``--soak S``: ``--clients`` closed-loop streaming clients for S seconds; the server's RSS is sampled every
``--sample`` seconds; reported: RSS at the end of ``--warmup`` (median of its last 3 samples) and at the end
(median of the last 3), the growth between them in %, and the slope after warm-up (MiB/min, least squares).

Loopback only; every loop is bounded; servers are stopped with SIGTERM (killed if they hang).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from expertcache.results import append_jsonl  # rows whole or absent, to row files only

POLICIES = {"original": ["--policy", "original"], "cache-prior": ["--policy", "cache-prior", "--lam", "0.5"]}
TEXT_PROMPTS = ["The kernel", "To configure the network, open the settings and", "apt-get install",
                "In 1990 the city of", "Once upon a time there was", "The history of the Roman Empire",
                "A B C D E F G", "The river flows into the"]


def start_server(model: str, policy: str, capacity: int, max_batch: int, io: str, extra: list[str]):
    cmd = [sys.executable, "-m", "expertcache.cli.main", "serve", "--model", model, "--port", "0", "--io", io,
           "--cache-experts", str(capacity), "--max-batch", str(max_batch), "--max-queue", "256", "--threads", "1",
           *POLICIES[policy], *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stderr.readline()
    if " on http://" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line}{proc.stderr.read()[-2000:]}")
    url = re.search(r" on (http://\S+)/v1", line).group(1)  # the API base; the live view's URL may follow
    return proc, url, line.strip()


def stop_server(proc) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.stderr.read()


def one_request(client: httpx.Client, url: str, model: str, prompt, tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    times, final = [], None
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                raise RuntimeError(d["error"])
            times.append(time.perf_counter())
            if d["choices"] and d["choices"][0]["finish_reason"] is not None:
                final = d
    if final is None:
        raise RuntimeError("stream ended without a final chunk")
    tok_times = times[:-1] if len(times) > 1 else times  # the last chunk carries usage only
    return dict(t0=t0, t_end=time.perf_counter(), ttft=tok_times[0] - t0, itl=list(np.diff(tok_times)),
                tokens=final["usage"]["completion_tokens"], ec=final["expertcache"])


def run_level(url: str, model: str, prompts: list, c: int, rounds: int, tokens: int) -> dict:
    results, errors = [], []
    lock = threading.Lock()

    def client_loop(i: int):
        with httpx.Client() as client:
            for k in range(rounds):
                try:
                    r = one_request(client, url, model, prompts[(i * rounds + k) % len(prompts)], tokens)
                except Exception as exc:  # noqa: BLE001 - reported
                    with lock:
                        errors.append(repr(exc))
                    return
                with lock:
                    results.append(r)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(c)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[:3]}")
    toks = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    hits = sum(r["ec"]["hits"] for r in results)
    misses = sum(r["ec"]["misses"] for r in results)
    return dict(concurrency=c, requests=len(results), tokens=toks, wall_s=wall, agg_tok_s=toks / wall,
                ttft_p50=float(np.percentile(ttft, 50)), ttft_p95=float(np.percentile(ttft, 95)),
                itl_p50=float(np.percentile(itl, 50)) if itl else None,
                itl_p95=float(np.percentile(itl, 95)) if itl else None,
                hit_rate=hits / (hits + misses) if hits + misses else None,
                mib_read_per_token=sum(r["ec"]["bytes_read"] for r in results) / toks / 2**20,
                mean_batch=float(np.mean([r["ec"]["mean_batch"] for r in results])))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def soak(proc, url: str, model: str, prompts: list, a, base: dict) -> dict:
    """``a.clients`` closed-loop clients for ``a.soak`` seconds; RSS sampled every ``a.sample`` seconds.
    Samples: (seconds, RSS KiB, tokens served so far, the server's threads)."""
    stop = threading.Event()
    counts = {"requests": 0, "tokens": 0, "errors": 0}
    lock = threading.Lock()

    def client_loop(i: int):
        k = 0
        with httpx.Client() as client:
            while not stop.is_set():
                try:
                    r = one_request(client, url, model, prompts[(i + k) % len(prompts)], a.tokens)
                    with lock:
                        counts["requests"] += 1
                        counts["tokens"] += r["tokens"]
                except Exception as exc:  # noqa: BLE001 - counted, the first one printed
                    with lock:
                        counts["errors"] += 1
                        if counts["errors"] == 1:
                            print(f"soak: a request failed: {exc!r}", file=sys.stderr)
                    time.sleep(0.1)
                k += 1

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(a.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    samples = []
    while (now := time.perf_counter() - t0) < a.soak:
        samples.append((round(now, 1), rss_kib(proc.pid), counts["tokens"], thread_count(proc.pid)))
        time.sleep(a.sample)
    stop.set()
    for t in threads:
        t.join(120)
    warm = [s for s in samples if s[0] <= a.warmup][-3:]
    last = samples[-3:]
    rss_warm = float(np.median([s[1] for s in warm])) / 1024
    rss_end = float(np.median([s[1] for s in last])) / 1024
    after = [s for s in samples if s[0] >= a.warmup]
    slope = float(np.polyfit([s[0] / 60 for s in after], [s[1] / 1024 for s in after], 1)[0]) if len(after) > 2 else None
    row = dict(base, kind="serve-soak", clients=a.clients, soak_s=a.soak, warmup_s=a.warmup, **counts,
               rss_warm_mib=rss_warm, rss_end_mib=rss_end, growth_pct=100 * (rss_end - rss_warm) / rss_warm,
               slope_mib_per_min=slope, threads_warm=warm[-1][3], threads_end=last[-1][3], samples=samples)
    print(f"soak {a.soak:g} s, {a.clients} clients: {counts['requests']} requests, {counts['tokens']} tokens, "
          f"{counts['errors']} errors; RSS after {a.warmup:g} s warm-up {rss_warm:.1f} MiB, at the end {rss_end:.1f} "
          f"MiB: {row['growth_pct']:+.2f} % (slope {slope if slope is None else round(slope, 3)} MiB/min); server threads "
          f"{row['threads_warm']} -> {row['threads_end']}")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="granular")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 32])
    ap.add_argument("--tokens", type=int, default=32, help="tokens per request (default 32)")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client per level (default 2)")
    ap.add_argument("--repeats", type=int, default=1, help="repeat the levels (interleaved per policy); medians")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--io", default="direct", choices=("direct", "fadvise", "cached"))
    ap.add_argument("--tier", default="disk", choices=("disk", "host"), help="where the experts live (default disk)")
    ap.add_argument("--prefill-chunk", type=int, default=128, help="the server's --prefill-chunk (default 128)")
    ap.add_argument("--prefill-delay", type=float, nargs="+", default=None, metavar="F",
                    help="the server's --prefill-delay (default: the server's); several values are compared as "
                         "separate policies (e.g. cache-prior@2), interleaved")
    ap.add_argument("--rss-tokens", type=int, default=0,
                    help="instead of the levels: serve this many tokens at 16 clients and sample the server's RSS")
    ap.add_argument("--soak", type=float, default=0, metavar="S",
                    help="instead of the levels: --clients clients for S seconds, RSS growth after --warmup")
    ap.add_argument("--warmup", type=float, default=60, help="soak: seconds before the RSS baseline (default 60)")
    ap.add_argument("--clients", type=int, default=16, help="soak: concurrent clients (default 16)")
    ap.add_argument("--sample", type=float, default=5, help="soak: RSS sampling period in seconds (default 5)")
    ap.add_argument("--out", default=None, help="append JSONL rows here")
    a = ap.parse_args(argv)
    from expertcache.results import check_rows_out

    check_rows_out(ap, a.out)  # rows go to a row file only: never appended to notes.md
    if a.soak and a.soak <= a.warmup:
        ap.error("--soak must be longer than --warmup")

    from transformers import AutoConfig

    from expertcache.offload.runtime import resolve_model_path

    path = resolve_model_path(a.model)
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    n_exp = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    capacity = n_exp // 4
    name = a.model if a.model in ("granular", "coarse") else path.name
    if (path / "tokenizer.json").is_file():
        prompts = TEXT_PROMPTS
    else:  # no tokenizer (random-weight bench model): prompts are token ids
        rng = random.Random(0)
        prompts = [[rng.randrange(cfg.vocab_size) for _ in range(16)] for _ in range(8)]
    base = dict(model=name, machine=platform.machine(), cpus=os.cpu_count(), capacity=capacity,
                num_experts=n_exp, tokens_per_request=a.tokens, io=a.io, load_avg=os.getloadavg()[0],
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    extra = ["--tier", a.tier, "--prefill-chunk", str(a.prefill_chunk)]
    base.update(tier=a.tier, prefill_chunk=a.prefill_chunk)
    rows = []
    if a.soak:
        policy = a.policies[0]
        proc, url, banner = start_server(a.model, policy, capacity, a.max_batch, a.io, extra)
        print(banner, file=sys.stderr)
        try:
            rows.append(soak(proc, url, name, prompts, a, dict(base, policy=policy)))
        finally:
            print(stop_server(proc)[-300:], file=sys.stderr)
    elif a.rss_tokens:
        policy = a.policies[0]
        proc, url, banner = start_server(a.model, policy, capacity, a.max_batch, a.io, extra)
        try:
            run_level(url, name, prompts, 16, 2, a.tokens)  # warm-up
            samples, served = [], 0
            t0 = time.perf_counter()
            while served < a.rss_tokens:
                lv = run_level(url, name, prompts, 16, 1, a.tokens)
                served += lv["tokens"]
                samples.append((served, rss_kib(proc.pid)))
                print(f"  {served} tokens, RSS {samples[-1][1] / 1024:.1f} MiB", file=sys.stderr)
            kib = [s for _, s in samples]
            row = dict(base, kind="serve-rss", policy=policy, served_tokens=served, wall_s=time.perf_counter() - t0,
                       rss_first_mib=kib[0] / 1024, rss_last_mib=kib[-1] / 1024, rss_max_mib=max(kib) / 1024,
                       rss_min_mib=min(kib) / 1024, rss_spread=(max(kib) - min(kib)) / min(kib), samples=samples)
            rows.append(row)
            print(f"RSS over {served} tokens after warm-up: first {row['rss_first_mib']:.1f} MiB, last "
                  f"{row['rss_last_mib']:.1f} MiB, min {row['rss_min_mib']:.1f}, max {row['rss_max_mib']:.1f} "
                  f"(spread {100 * row['rss_spread']:.2f} %)")
        finally:
            print(stop_server(proc)[-300:], file=sys.stderr)
    else:
        per: dict[tuple[str, int], list[dict]] = {}
        variants = [(p, p, None) for p in a.policies] if a.prefill_delay is None else \
            [(f"{p}@{d:g}", p, d) for p in a.policies for d in a.prefill_delay]
        for rep in range(a.repeats):
            for label, policy, delay in variants:
                more = [] if delay is None else ["--prefill-delay", str(delay)]
                proc, url, banner = start_server(a.model, policy, capacity, a.max_batch, a.io, extra + more)
                print(banner, file=sys.stderr)
                try:
                    run_level(url, name, prompts, 2, 1, min(8, a.tokens))  # warm-up (compiles, first reads)
                    for c in a.concurrency:
                        lv = run_level(url, name, prompts, c, a.rounds, a.tokens)
                        lv.update(base, kind="serve", policy=policy, repeat=rep, prefill_delay=delay,
                                  rounds=a.rounds, max_batch=a.max_batch)
                        per.setdefault((label, c), []).append(lv)
                        rows.append(lv)
                        print(f"  {label:12s} c={c:3d}: {lv['agg_tok_s']:7.2f} tok/s, TTFT p50 {lv['ttft_p50']:.3f} "
                              f"p95 {lv['ttft_p95']:.3f} s, ITL p50 {lv['itl_p50']:.3f} p95 {lv['itl_p95']:.3f} s, "
                              f"hit {lv['hit_rate']:.3f}, batch {lv['mean_batch']:.1f}", file=sys.stderr)
                finally:
                    stop_server(proc)
        print(f"\n{name}: C = {capacity}/{n_exp}, {a.tokens} tokens/request, {a.rounds} request(s)/client, "
              f"tier={a.tier}, io={a.io}, prefill chunk {a.prefill_chunk}, medians of {a.repeats}\n")
        print("| policy | clients | aggregate tok/s | × 1 client | TTFT p50 / p95 (s) | ITL p50 / p95 (s) | hit rate | "
              "mean batch |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for policy, _, _ in variants:
            one = None
            for c in a.concurrency:
                m = {k: float(np.median([r[k] for r in per[(policy, c)]])) for k in
                     ("agg_tok_s", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "hit_rate", "mean_batch")}
                one = m["agg_tok_s"] if c == a.concurrency[0] else one
                print(f"| {policy} | {c} | {m['agg_tok_s']:.2f} | {m['agg_tok_s'] / one:.2f} | {m['ttft_p50']:.3f} / "
                      f"{m['ttft_p95']:.3f} | {m['itl_p50']:.3f} / {m['itl_p95']:.3f} | {m['hit_rate']:.3f} | "
                      f"{m['mean_batch']:.1f} |")
    if a.out:
        for r in rows:
            append_jsonl(a.out, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
