"""Decode-throughput benchmark of routing policies at equal memory, with the I/O roofline.

For one model, one tier and one cache size C, :func:`run_bench`:

1. per round, measures the tier's bandwidth (``measure_bandwidth``: reads of random experts, bytes / second)
   and the all-resident compute time per decoded token (a second runtime with C = N, every expert loaded
   beforehand, so no miss: ``t_compute``);
2. in the same round, for every policy (order rotated per round), starts from empty caches, prefills the
   same prompt and decodes ``tokens`` tokens (greedy, or teacher-forced with ``forced_BN`` -- needed for
   random-weight models, whose greedy output repeats one token), timing the decode steps;
3. reports per policy the medians over rounds of tok/s, hit rate, misses and bytes per token, and the
   roofline ``predicted s/token = t_compute + misses/token × expert_bytes / bandwidth`` with the ratio
   measured / predicted.

Every (policy, round) is one JSONL row with the full resolved configuration; ``table`` formats the medians.
"""

from __future__ import annotations

import platform
import random
import statistics

import numpy as np
import torch

from expertcache.offload.runtime import OffloadConfig, OffloadedModel
from expertcache.routing import RoutingConfig

__all__ = ["BENCH_POLICIES", "policy_set", "measure_bandwidth", "run_bench", "table", "machine_info",
           "heldout_ppl", "heldout_stream"]


def policy_set(k: int) -> dict[str, tuple[RoutingConfig, str]]:
    """Name → (routing, eviction) of the benchmarked policies (strengths chosen per K)."""
    return {
        "original+lru": (RoutingConfig("original"), "lru"),
        "original+lfu": (RoutingConfig("original"), "lfu"),
        "prune": (RoutingConfig("prune", h=max(1, k // 2)), "lru"),
        "max-rank": (RoutingConfig("max-rank", m=min(2 * k, 64), top_j=1), "lru"),
        "cumsum": (RoutingConfig("cumsum", p=0.9, top_j=1), "lru"),
        "cache-prior": (RoutingConfig("cache-prior", lam=0.5, top_j=1), "lru"),
        "eras-threshold": (RoutingConfig("eras-threshold", alpha=0.05, top_j=1), "lru"),
        "eras-bias": (RoutingConfig("eras-bias", beta=1.0, top_j=1), "lru"),
    }


BENCH_POLICIES = tuple(policy_set(2))


def machine_info() -> dict:
    info = dict(python=platform.python_version(), torch=torch.__version__, machine=platform.machine(),
                processor=platform.processor(), threads=torch.get_num_threads(),
                cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    try:
        with open("/proc/cpuinfo") as f:
            names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
        info.update(cpu=names[0] if names else None, cores=len(names))
    except OSError:
        pass
    return info


def measure_bandwidth(rt: OffloadedModel, n: int = 16, seed: int = 0) -> float:
    """Bytes per second of ``n`` reads of random experts through the runtime's tier (into a scratch slot)."""
    rng = random.Random(seed)
    stats0 = (rt.tier.stats.bytes_read, rt.tier.stats.seconds, rt.tier.stats.loads)
    st = rt.states[0]
    for _ in range(n):
        m = rt.layers[rng.randrange(len(rt.layers))]
        rt._load(rt.states[m.index], rng.randrange(rt.num_experts), st.pool.scratch)
    b = rt.tier.stats.bytes_read - stats0[0]
    s = rt.tier.stats.seconds - stats0[1]
    rt.tier.stats.bytes_read, rt.tier.stats.seconds, rt.tier.stats.loads = stats0
    return b / s if s > 0 else float("inf")


def _decode(rt: OffloadedModel, prompt_BS: torch.Tensor, tokens: int, forced_BN: torch.Tensor | None = None) -> dict:
    return rt.generate(prompt_BS, tokens, forced_BN=forced_BN)


def run_bench(path, offload: OffloadConfig, *, policies: list[str] | None = None, prompt_BS: torch.Tensor,
              tokens: int = 32, repeats: int = 3, dtype=None, forced_BN: torch.Tensor | None = None, on_row=None,
              log=print, prefetch=None) -> dict:
    """Run the benchmark (see the module docstring). ``forced_BN``: teacher-forced decode tokens (the same for
    every policy) instead of greedy decoding. ``on_row(row)`` receives every JSONL row. ``prefetch(rt)`` (MELINOE):
    called after each policy's fresh caches are set up, before decoding; returns the experts it loaded. Returns
    ``{"summary": [...], "rows": [...], "config": ...}``.

    Each round measures, under the same machine conditions: the tier bandwidth (8 random expert reads), the
    all-resident compute time per token (a second runtime with C = N, every expert loaded before the prompt)
    and every policy (order rotated per round)."""
    rt = OffloadedModel.from_pretrained(path, offload, dtype=dtype)
    full = OffloadConfig(tier=offload.tier, io=offload.io, quant=offload.quant, group=offload.group,
                         context=offload.context, batch=offload.batch)
    resident = OffloadedModel.from_pretrained(path, full, dtype=dtype)
    resident.warm(range(resident.num_experts))
    pset = policy_set(rt.top_k)
    names = list(policies or pset)
    unknown = [n for n in names if n not in pset]
    if unknown:
        raise ValueError(f"unknown benchmark policies {unknown}; choose from {', '.join(pset)}")
    _decode(rt, prompt_BS, min(tokens, 4), forced_BN)  # warm-up (one-time kernel initialisation), not timed
    log(f"expert {rt.expert_bytes / 2**20:.2f} MiB; C={rt.capacity}/{rt.num_experts}; tier {rt.offload.tier}"
        f"{', io=' + rt.offload.io if rt.offload.tier == 'disk' else ''}")
    freq = None
    if "eras-bias" in names:  # activation profile from an original-routing run (ERAS biasing needs one)
        from expertcache.sim import activation_frequency

        rt.configure(routing=RoutingConfig(), eviction="lru", record=True)
        _decode(rt, prompt_BS, tokens, forced_BN)
        freq = activation_frequency(rt.recorded_ids_TLK(), rt.num_experts)
        rt.configure(record=False)
    rows = []
    for rep in range(repeats):
        bw = measure_bandwidth(rt, n=8, seed=rep)
        resident.tier.stats = type(resident.tier.stats)()
        r0 = _decode(resident, prompt_BS, tokens, forced_BN)
        assert r0["decode_stats"]["misses"] == 0
        t_compute = r0["decode_s"] / max(1, r0["decode_tokens"])
        log(f"  [{rep + 1}/{repeats}] bandwidth {bw / 1e6:.0f} MB/s, all-resident {t_compute * 1e3:.1f} ms/token")
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            routing, eviction = pset[name]
            rt.configure(routing=routing, eviction=eviction, freq_LE=freq if routing.policy == "eras-bias" else None)
            prefetched = prefetch(rt) if prefetch is not None else 0
            r = _decode(rt, prompt_BS, tokens, forced_BN)
            s = r["decode_stats"]
            n = max(1, r["decode_tokens"])
            per_tok = r["decode_s"] / n
            predicted = t_compute + s["misses"] / n * rt.expert_bytes / bw
            row = dict(kind="offload-bench", name=name, repeat=rep, tokens=n, batch=int(prompt_BS.shape[0]),
                       prompt_tokens=int(prompt_BS.shape[1]), forced=forced_BN is not None,
                       tok_s=n * prompt_BS.shape[0] / r["decode_s"],
                       s_per_token=per_tok, hit_rate=s["hit_rate"], misses_per_token=s["misses"] / n,
                       bytes_per_token=s["bytes_read"] / n, io_s_per_token=s["io_seconds"] / n,
                       predicted_s_per_token=predicted, roofline_ratio=per_tok / predicted,
                       bandwidth=bw, t_compute=t_compute, config=rt.describe(), machine=machine_info(),
                       prefetched=prefetched)
            rows.append(row)
            if on_row is not None:
                on_row(row)
            log(f"  [{rep + 1}/{repeats}] {name:<15} {row['tok_s']:8.2f} tok/s  hit {s['hit_rate']:.3f}  "
                f"{row['bytes_per_token'] / 2**20:8.1f} MiB/token  measured/roofline {row['roofline_ratio']:.2f}")
    summary = []
    for name in names:
        rs = [r for r in rows if r["name"] == name]
        med = {k: statistics.median(r[k] for r in rs) for k in
               ("tok_s", "s_per_token", "hit_rate", "misses_per_token", "bytes_per_token", "predicted_s_per_token",
                "roofline_ratio", "bandwidth", "t_compute")}
        summary.append(dict(name=name, routing=pset[name][0].label(), eviction=pset[name][1], **med))
    base = next((s for s in summary if s["name"] == "original+lru"), None)
    for s in summary:
        s["speedup_vs_lru"] = s["tok_s"] / base["tok_s"] if base else None
    return dict(summary=summary, rows=rows, config=rt.describe())


def table(result: dict) -> str:
    """Markdown table of a :func:`run_bench` result (medians)."""
    lines = ["| policy | routing | tok/s | × original+LRU | hit rate | MiB read/token | ms/token | "
             "roofline ms/token | measured/roofline |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result["summary"]:
        sp = "" if s["speedup_vs_lru"] is None else f"{s['speedup_vs_lru']:.2f}"
        lines.append(f"| {s['name']} | {s['routing']}+{s['eviction']} | {s['tok_s']:.2f} | {sp} | {s['hit_rate']:.3f} | "
                     f"{s['bytes_per_token'] / 2**20:.1f} | {s['s_per_token'] * 1e3:.1f} | "
                     f"{s['predicted_s_per_token'] * 1e3:.1f} | {s['roofline_ratio']:.2f} |")
    return "\n".join(lines)


@torch.inference_mode()
def heldout_ppl(rt: OffloadedModel, stream_N: np.ndarray, seq_len: int = 128, windows: int = 16) -> float:
    """Perplexity of ``rt`` on ``windows`` consecutive non-overlapping windows of ``seq_len`` tokens of a
    held-out token stream (each window scored independently, all positions but the first)."""
    nll, count = 0.0, 0
    for w in range(windows):
        chunk = stream_N[w * seq_len:(w + 1) * seq_len]
        if len(chunk) < seq_len:
            break
        ids = torch.as_tensor(chunk.astype(np.int64))[None]
        logits = rt.forward(ids).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:].to(logits.device), reduction="sum").item()
        count += seq_len - 1
    return float(np.exp(nll / count))


def heldout_stream(path, max_docs: int = 4000) -> np.ndarray:
    """Token stream of the held-out split of the training corpus (see expertcache.train.data)."""
    from expertcache.train.data import encode_stream, load_documents, resolve_data_dir, split_documents
    from expertcache.train.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    _, held = split_documents(load_documents(resolve_data_dir(), max_docs=max_docs))
    return encode_stream(tok, [d["text"] for d in held[:64]], tok.eos_token_id)
