"""Issue 23's GPU check: the ``-m gpu`` tests and the decode-throughput table on one CUDA device, in one run
(budget: about 8 minutes on one H100), written as one JSON and one markdown report.

    python benchmarks/gpu_check.py [--device cuda:0] [--layers 16] [--tokens 64] [--repeats 2] [--readers 4]
        [--skip-tests] [--out-dir benchmarks/results/gpu_check-<time>]

1. ``pytest -m gpu tests/`` (every test skipped without CUDA runs here): logits against stock transformers on
   the device for all eight families, live hit/miss counts against ``sim.replay``, CPU vs GPU greedy tokens.
2. Host -> device bandwidth: a plain pinned ``copy_`` of one expert (the reference, same size) against the
   runtime's own reads (``measure_bandwidth``: its copy stream, its slots), in the same run.
3. The table, on the OLMoE-1B-7B-shape random-weight checkpoint (``--layers`` decoder layers, bf16, 64 experts
   of 12.6 MB, top-8; written once into the bench-model cache, ~14 GB at 16 layers), 64 teacher-forced
   tokens, medians of ``--repeats`` rounds: stock transformers (whole model on the device); expertcache at
   C = N; C = N/4 and N/2 with original + LRU and Cache-Prior λ 0.5 (host tier); ``--memory 3GiB``; C = N/4
   on the disk tier (O_DIRECT).
4. Launches and host waits per decoded token (issue 35), from the CUDA runtime calls ``torch.profiler`` records
   (kernel launches, stream/event/device synchronisations, memcpy calls; the prefill subtracted: a run of the
   same prompt with no decode step is profiled too), for C = N and C = N/4 with ``original`` and Cache-Prior,
   prefetch off and on; the pinned bytes of the host tier against the experts' bytes. The report ends with
   the table of issue 35's targets beside the measured figures (:data:`TARGETS`).

The same launch and wait counts are pinned on the CPU by ``tests/test_launches.py`` (the tracked-tensor
proxy, ``tests/device_proxy.py``): a GPU session runs this script first and compares.

Without a CUDA device it prints one line saying so and exits with status 2 (nothing is written).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


#: issue 35's targets: (what, target, key of the measured figure in the report's ``targets`` section)
TARGETS = [("device->host waits per MoE layer (+1/token sampling, +1/token first guess with prefetch)", "1",
            "syncs_per_layer"),
           ("blocking host->device copies per MoE layer", "0", "blocking_h2d"),
           ("MoE block launches per layer", "<= 45", "moe_launches_per_layer"),
           ("pinned bytes / expert bytes", "<= 1.05", "pinned_ratio"),
           ("C = N tok/s (OLMoE shapes, 16 layers, bf16, H100)", ">= 150", "tok_s_C=N"),
           ("C = 16 Cache-Prior tok/s", ">= 80", "tok_s_C=16_cache-prior"),
           ("C = 16 LRU tok/s", ">= 35", "tok_s_C=16_lru"),
           ("runtime copies vs a plain pinned copy", ">= 0.80", "runtime_vs_pinned")]

_LAUNCH = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
_SYNC = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
_MEMCPY = ("cudaMemcpyAsync", "cudaMemcpy")


def step_counts(path, cfg, routing, prompt, forced, device, tokens: int = 8) -> dict:
    """Per decoded token of the offloaded runtime on ``device``: CUDA kernel launches, synchronisations (the
    host waiting: device->host reads) and memcpy calls, per token and per MoE layer, from ``torch.profiler``'s
    CUDA runtime events; the prefill (and the first token's choice) subtracted by profiling the same
    ``generate`` with no decode step. Also the host tier's pinned bytes over the experts' bytes."""
    from collections import Counter

    import torch
    from torch.profiler import ProfilerActivity, profile

    from expertcache.offload import OffloadedModel

    rt = OffloadedModel.from_pretrained(path, cfg, dtype=torch.bfloat16, device=device, routing=routing)
    try:
        with torch.inference_mode():
            rt.generate(prompt, 4, forced_BN=forced)  # warm: caches, allocator, kernels

            def run(n: int) -> Counter:
                rt.configure()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    rt.generate(prompt, n, forced_BN=forced)
                    torch.cuda.synchronize(device)
                return Counter(e.name for e in prof.events())

            a, b = run(1), run(tokens + 1)
        d = lambda names: sum(b[k] - a[k] for k in names) / tokens
        layers = len(rt.layers)
        experts = rt.expert_bytes * layers * rt.num_experts
        return dict(launches=d(_LAUNCH), syncs=d(_SYNC), memcpy=d(_MEMCPY), syncs_per_layer=d(_SYNC) / layers,
                    memcpy_per_layer=d(_MEMCPY) / layers, layers=layers,
                    pinned_ratio=rt.plan.pinned_bytes / experts if rt.plan.pinned_bytes else None)
    finally:
        rt.close()


def _best(tok: dict, config: str, policy: str) -> float | None:
    """The faster of the eager and the captured (--compile) runs of ``config`` with ``policy``."""
    got = [tok.get(f"{config}{c}: {policy}") for c in ("", ", --compile")]
    return max((v for v in got if v is not None), default=None)


def _fail(msg: str) -> int:
    print(f"gpu_check: {msg}", file=sys.stderr)
    return 2


def pinned_copy_bandwidth(nbytes: int, device, n: int = 20) -> dict:
    """Bytes/s of a plain ``copy_`` of ``nbytes`` host -> device: pinned and pageable source (median of ``n``)."""
    import torch

    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, pin in (("pinned", True), ("pageable", False)):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        src.fill_(1)
        times = []
        for _ in range(n):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / statistics.median(times)
    return out


def stock_tok_s(path, prompt, forced, device, repeats: int) -> dict:
    """Stock transformers with the whole model on the device: teacher-forced decode tok/s (median)."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    rates = []
    with torch.inference_mode():
        for r in range(repeats + 1):  # the first is a warm-up
            out = model(input_ids=prompt.to(device), past_key_values=DynamicCache(config=model.config), use_cache=True)
            past = out.past_key_values
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for i in range(forced.shape[1]):
                out = model(input_ids=forced[:, i:i + 1].to(device), past_key_values=past, use_cache=True)
                past = out.past_key_values
                out.logits[:, -1].argmax(-1).cpu()  # what a decode loop reads each step
            torch.cuda.synchronize(device)
            if r:
                rates.append(forced.shape[1] / (time.perf_counter() - t0))
    del model
    torch.cuda.empty_cache()
    return dict(name="stock transformers", tok_s=statistics.median(rates))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="CUDA device (default: cuda = cuda:0)")
    ap.add_argument("--layers", type=int, default=16, help="decoder layers of the OLMoE-shape model (1..16)")
    ap.add_argument("--tokens", type=int, default=64, help="teacher-forced decode tokens per run")
    ap.add_argument("--repeats", type=int, default=2, help="rounds per configuration (medians)")
    ap.add_argument("--readers", type=int, default=4, help="reader threads")
    ap.add_argument("--skip-tests", action="store_true", help="do not run pytest -m gpu")
    ap.add_argument("--out-dir", default=None, help="report folder (default: benchmarks/results/gpu_check-<time>)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        return _fail(f"no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda}); run it on a "
                     "machine with a GPU")
    from expertcache.device import resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        return _fail(str(exc))
    if device.type != "cuda":
        return _fail(f"--device {args.device}: the GPU check needs a CUDA device")
    if not 1 <= args.layers <= 16 or args.tokens < 2 or args.repeats < 1:
        return _fail("--layers must be in 1..16, --tokens >= 2, --repeats >= 1")
    out_dir = Path(args.out_dir or ROOT / "benchmarks" / "results" / f"gpu_check-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    from expertcache.offload import OffloadConfig
    from expertcache.offload.bench import machine_info, run_bench
    from expertcache.offload.make_model import make_bench_model

    report = dict(machine=machine_info(), device=str(device), device_name=torch.cuda.get_device_name(device),
                  args=vars(args), sections={})
    log = lambda *a: print(*a, flush=True)
    if not args.skip_tests:
        log("## pytest -m gpu")
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                              str(ROOT / "tests")], cwd=ROOT, capture_output=True, text=True)
        tail = (res.stdout + res.stderr).strip().splitlines()[-15:]
        log("\n".join(tail))
        report["sections"]["tests"] = dict(returncode=res.returncode, seconds=time.perf_counter() - t0, tail=tail)
    log(f"## model: olmoe-1b-7b shapes, {args.layers} layers, bf16 (random weights)")
    path = make_bench_model("olmoe-1b-7b", layers=args.layers)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 50304, (1, 16), generator=g)
    forced = torch.randint(3, 50304, (1, args.tokens), generator=g)
    rows = []
    stock = stock_tok_s(path, prompt, forced, device, args.repeats)
    rows.append(dict(stock, config="whole model on the device"))
    log(f"stock transformers: {stock['tok_s']:.2f} tok/s")
    n = 64
    ctx = 16 + args.tokens
    io = dict(readers=args.readers, context=ctx)
    configs = [("C=N (all resident), host", OffloadConfig(tier="host", capacity=n, **io), ["original+lru"]),
               ("C=N/4, host", OffloadConfig(tier="host", capacity=n // 4, **io), ["original+lru", "cache-prior"]),
               ("C=N/2, host", OffloadConfig(tier="host", capacity=n // 2, **io), ["original+lru", "cache-prior"]),
               ("memory 3GiB, host", OffloadConfig(tier="host", memory="3GiB", **io), ["original+lru", "cache-prior"]),
               ("C=N/4, disk (O_DIRECT)", OffloadConfig(tier="disk", io="direct", capacity=n // 4, **io),
                ["original+lru", "cache-prior"]),
               # the captured decode step (models/captured.py: static KV cache, one graph per token, the experts
               # computed in the graph from their slots, CUDA graphs between the host's operators)
               ("C=N (all resident), host, --compile", OffloadConfig(tier="host", capacity=n, compile=True, **io),
                ["original+lru"]),
               ("C=N/4, host, --compile", OffloadConfig(tier="host", capacity=n // 4, compile=True, **io),
                ["original+lru", "cache-prior"])]
    bandwidth = None
    for label, cfg, policies in configs:
        log(f"## {label}")
        try:
            res = run_bench(path, cfg, policies=policies, prompt_BS=prompt, tokens=args.tokens, repeats=args.repeats,
                            forced_BN=forced, dtype=torch.bfloat16, device=device, log=log)
        except Exception as exc:  # one failing configuration must not lose the others
            rows.append(dict(name=label, error=f"{type(exc).__name__}: {exc}"))
            log(f"  failed: {type(exc).__name__}: {exc}")
            continue
        for s in res["summary"]:
            rows.append(dict(name=f"{label}: {s['name']}", tok_s=s["tok_s"], hit_rate=s["hit_rate"],
                             mib_per_token=s["bytes_per_token"] / 2**20, runtime_bandwidth=s["bandwidth"],
                             capacity=res["config"]["capacity"], tier=cfg.tier,
                             captured_experts=res["config"].get("captured_experts")))
        if bandwidth is None and cfg.tier == "host":
            ref = pinned_copy_bandwidth(res["config"]["expert_bytes"], device)
            bandwidth = dict(expert_bytes=res["config"]["expert_bytes"], runtime=res["summary"][0]["bandwidth"],
                             plain_pinned=ref["pinned"], plain_pageable=ref["pageable"])
            bandwidth["runtime_vs_pinned"] = bandwidth["runtime"] / bandwidth["plain_pinned"]
            log(f"bandwidth: runtime {bandwidth['runtime'] / 1e9:.1f} GB/s, plain pinned copy_ "
                f"{ref['pinned'] / 1e9:.1f} GB/s ({bandwidth['runtime_vs_pinned']:.0%}), pageable "
                f"{ref['pageable'] / 1e9:.1f} GB/s")
        torch.cuda.empty_cache()
    report["sections"]["table"] = rows
    report["sections"]["bandwidth"] = bandwidth
    log("## launches and host waits per decoded token")
    from expertcache.routing import RoutingConfig

    counts = []
    for cap in (n, n // 4):
        for pol in ("original", "cache-prior"):
            for pf in (0, 2):
                cfg = OffloadConfig(tier="host", capacity=cap, prefetch=pf, context=ctx)
                routing = RoutingConfig() if pol == "original" else RoutingConfig("cache-prior", lam=0.5)
                name = f"C={cap} {pol} prefetch={pf}"
                try:
                    c = step_counts(path, cfg, routing, prompt, forced, device)
                except Exception as exc:
                    counts.append(dict(name=name, error=f"{type(exc).__name__}: {exc}"))
                    log(f"  {name} failed: {type(exc).__name__}: {exc}")
                    continue
                counts.append(dict(c, name=name))
                log(f"  {name}: {c['launches']:.0f} launches, {c['syncs_per_layer']:.2f} syncs and "
                    f"{c['memcpy_per_layer']:.2f} memcpy per MoE layer")
                torch.cuda.empty_cache()
    report["sections"]["counts"] = counts
    tok = {r["name"]: r["tok_s"] for r in rows if "tok_s" in r and "name" in r}
    ok = [c for c in counts if "error" not in c]
    measured = {"syncs_per_layer": max((c["syncs_per_layer"] for c in ok), default=None),
                "pinned_ratio": next((c["pinned_ratio"] for c in ok if c["pinned_ratio"]), None),
                "tok_s_C=N": _best(tok, "C=N (all resident), host", "original+lru"),
                "tok_s_C=16_cache-prior": _best(tok, "C=N/4, host", "cache-prior"),
                "tok_s_C=16_lru": _best(tok, "C=N/4, host", "original+lru"),
                "runtime_vs_pinned": bandwidth and bandwidth["runtime_vs_pinned"],
                "blocking_h2d": "see tests/test_launches.py (CPU proxy)",
                "moe_launches_per_layer": "see tests/test_launches.py (CPU proxy)"}
    report["sections"]["targets"] = measured
    report["seconds"] = time.perf_counter() - t_start
    md = [f"# GPU check ({report['device_name']}, {report['device']})", "",
          f"torch {torch.__version__}, {args.layers} layers, {args.tokens} teacher-forced tokens, "
          f"{args.readers} readers, medians of {args.repeats}; {report['seconds']:.0f} s in all.", ""]
    if "tests" in report["sections"]:
        t = report["sections"]["tests"]
        md += ["## pytest -m gpu", "", f"exit status {t['returncode']}: `{t['tail'][-1] if t['tail'] else ''}`", ""]
    md += ["## decode throughput", "", "| configuration | tok/s | hit rate | MiB read / token |", "|---|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['name']} | failed: {r['error']} | | |")
            continue
        hr = f"{r['hit_rate']:.2f}" if "hit_rate" in r else "–"
        mib = f"{r['mib_per_token']:.0f}" if "mib_per_token" in r else "–"
        md.append(f"| {r['name']} | {r['tok_s']:.1f} | {hr} | {mib} |")
    if bandwidth:
        md += ["", "## host -> device bandwidth (one expert)", "",
               f"runtime reads {bandwidth['runtime'] / 1e9:.1f} GB/s; plain pinned `copy_` "
               f"{bandwidth['plain_pinned'] / 1e9:.1f} GB/s ({bandwidth['runtime_vs_pinned']:.0%}); pageable "
               f"{bandwidth['plain_pageable'] / 1e9:.1f} GB/s"]
    if counts:
        md += ["", "## launches and host waits per decoded token", "",
               "| configuration | launches / token | syncs / MoE layer | memcpy / MoE layer |", "|---|---:|---:|---:|"]
        for c in counts:
            md.append(f"| {c['name']} | failed: {c['error']} | | |" if "error" in c else
                      f"| {c['name']} | {c['launches']:.0f} | {c['syncs_per_layer']:.2f} | {c['memcpy_per_layer']:.2f} |")
    md += ["", "## issue 35's targets", "", "| target | wanted | measured |", "|---|---|---|"]
    for what, want, key in TARGETS:
        v = measured.get(key)
        md.append(f"| {what} | {want} | {'–' if v is None else (f'{v:.2f}' if isinstance(v, float) else v)} |")
    from expertcache.results import atomic_write_bytes

    atomic_write_bytes(out_dir / "gpu_check.json", json.dumps(report, indent=1, default=str).encode())
    atomic_write_bytes(out_dir / "gpu_check.md", ("\n".join(md) + "\n").encode())
    log(f"wrote {out_dir / 'gpu_check.json'} and {out_dir / 'gpu_check.md'}")
    return 0 if report["sections"].get("tests", {}).get("returncode", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
