"""Decode-throughput benchmark of routing policies at equal memory, against the physical floor.

For one model, one tier and one cache size C, :func:`run_bench` runs **inside the memory plan** (one
runtime; no all-resident reference model, which would need every expert in memory):

1. per round, measures the tier's bandwidth at the read size the runtime uses (one expert per read):
   ``bandwidth`` with the runtime's reader threads in parallel (what the overlapped runtime can get) and
   ``serial_bandwidth`` one read at a time;
2. in the same round, for every policy (order rotated per round), starts from empty caches, prefills the
   same prompt and decodes ``tokens`` tokens (greedy, or teacher-forced with ``forced_BN`` -- needed for
   random-weight models, whose greedy output repeats one token), timing the decode steps and the time the
   compute thread spent blocked on reads (``io_wait``);
3. reports per policy the medians over rounds of tok/s, hit rate, bytes per token and

   - compute s/token = (decode time - time blocked on reads) / tokens: the all-resident compute time,
     measured in the same run (the compute thread does exactly the work an all-resident model does; the
     reads run on reader threads and, with O_DIRECT into the slots, cost it no copies);
   - **floor** s/token = max(compute, bytes read per token / bandwidth) -- the physical limit: a token
     cannot be faster than its compute nor than the device can deliver its bytes; ``measured / floor``;
   - serial s/token = compute + bytes per token / serial bandwidth -- what strictly serial reads would
     take (the pre-overlap runtime), as a second column.

Every (policy, round) is one JSONL row with the full resolved configuration; ``table`` formats the medians.
"""

from __future__ import annotations

import os
import platform
import random
import statistics

import numpy as np
import torch

from expertcache.routing.registry import NEEDS_PROFILE, SPECS
from expertcache.offload.runtime import OffloadConfig, OffloadedModel
from expertcache.routing import RoutingConfig

__all__ = ["BENCH_POLICIES", "DEFAULT_BENCH", "bench_policies", "policy_set", "measure_bandwidth", "run_bench", "table", "machine_info",
           "heldout_ppl", "heldout_stream", "closed_loop_nll", "closed_loop_last_logits", "closed_loop_mmlu",
           "teacher_forced_logits"]


def _bench_strength(name: str, k: int) -> float | int:
    """The benchmarked value of a strength field (the papers' policies' settings, per K)."""
    return {"h": max(1, k // 2), "m": min(2 * k, 64), "p": 0.9, "lam": 0.5, "alpha": 0.05, "beta": 1.0}[name]


def policy_set(k: int) -> dict[str, tuple[RoutingConfig, str]]:
    """Name → (routing, eviction) of the benchmarkable policies (strengths chosen per K): original with LRU and
    with LFU, then every registered policy with LRU at its strength's benchmark value (``_bench_strength``),
    at the policy's default top-J."""
    out = {"original+lru": (RoutingConfig("original"), "lru"), "original+lfu": (RoutingConfig("original"), "lfu")}
    for s in SPECS.values():
        if s.strength is not None:
            out[s.name] = (RoutingConfig(s.name, **{s.strength: _bench_strength(s.strength, k)}), "lru")
    return out


def bench_policies() -> tuple[str, ...]:
    """The names ``--policies`` accepts (every registered policy, read now)."""
    return tuple(policy_set(2))


#: what a bench without ``--policies`` runs: the papers' policies
DEFAULT_BENCH = ("original+lru", "original+lfu", "prune", "max-rank", "cumsum", "cache-prior", "eras-threshold",
                 "eras-bias")
BENCH_POLICIES = DEFAULT_BENCH  # kept for importers: the default set


def machine_info() -> dict:
    """The machine of a benchmark row: Python, torch, the CPU (model, cores, its kernel-choosing ISA flags, ATen's
    dispatch capability and any ISA caps in the environment: :func:`~expertcache.offload.quant.cpu_description`)."""
    from expertcache.offload.quant import cpu_description
    from expertcache.train.card import cpu_name

    return dict(python=platform.python_version(), torch=torch.__version__, machine=platform.machine(),
                processor=platform.processor(), threads=torch.get_num_threads(),
                cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, cpu=cpu_name(),
                cores=os.cpu_count(), **{k: v for k, v in cpu_description().items() if k != "cpu"})


def measure_bandwidth(rt: OffloadedModel, n: int = 16, seed: int = 0, parallel: bool = True) -> float:
    """Bytes per second (wall clock) of ``n`` reads of random experts through the runtime's tier and reader
    threads, into the layers' cache slots (no extra memory; the caches are emptied first, as
    :meth:`OffloadedModel.configure` does, and left empty): up to ``min(readers, layers)`` expert reads in
    flight when ``parallel``, one at a time otherwise; each read as the runtime reads it. The tier's statistics are left untouched."""
    import time

    rng = random.Random(seed)
    rt.configure()  # empty caches: every cache slot is free
    stats0 = (rt.tier.stats.bytes_read, rt.tier.stats.seconds, rt.tier.stats.loads)
    wait0 = rt.io_wait_seconds
    dests = [(st, st.pool.free[-1]) for st in rt.states]
    depth = max(1, min(rt.readers.readers, len(dests))) if parallel else 1
    tickets = []
    t0 = time.perf_counter()
    for i in range(n):
        if len(tickets) >= depth:
            tickets.pop(0).wait()
        st, slot = dests[i % depth]
        e = rng.randrange(rt.num_experts)
        st.pool.placement.pop(slot, None)  # the slot no longer holds what its cached views describe
        tickets.append(rt.readers.submit(rt.read_job(st.moe.index, e, slot)))
    for t in tickets:
        t.wait()
    if rt.device.type == "cuda":  # pragma: no cover - GPU only: the copies are asynchronous (reads.py SlotReads.cuda_job)
        torch.cuda.synchronize(rt.device)
    wall = time.perf_counter() - t0
    b = rt.tier.stats.bytes_read - stats0[0]
    rt.tier.stats.bytes_read, rt.tier.stats.seconds, rt.tier.stats.loads = stats0
    rt.io_wait_seconds = wait0
    for st, slot in dests:
        st.pool.placement.pop(slot, None)
    return b / wall if wall > 0 else float("inf")


def run_bench(path, offload: OffloadConfig, *, policies: list[str] | None = None, prompt_BS: torch.Tensor,
              tokens: int = 32, repeats: int = 3, dtype=None, forced_BN: torch.Tensor | None = None, on_row=None,
              log=print, prefetch=None, device=None) -> dict:
    """Run the benchmark (see the module docstring). ``forced_BN``: teacher-forced decode tokens (the same for
    every policy) instead of greedy decoding. ``on_row(row)`` receives every JSONL row. ``prefetch(rt)`` (MELINOE):
    called after each policy's fresh caches are set up, before decoding; returns the experts it loaded. ``device``:
    the compute device (default CPU; every row records it). Returns
    ``{"summary": [...], "rows": [...], "config": ...}``.

    Each round measures, under the same machine conditions: the tier bandwidth (parallel and serial, 16
    random expert reads each) and every policy (order rotated per round). Only one runtime exists: the
    benchmark stays inside the memory plan (``--memory``)."""
    rt = OffloadedModel.from_pretrained(path, offload, dtype=dtype, device=device)
    pset = policy_set(rt.top_k)
    names = list(policies or DEFAULT_BENCH)
    unknown = [n for n in names if n not in pset]
    if unknown:
        raise ValueError(f"unknown benchmark policies {unknown}; choose from {', '.join(pset)}")
    rt.generate(prompt_BS, min(tokens, 4), forced_BN=forced_BN)  # warm-up (one-time kernel initialisation), not timed
    log(f"expert {rt.expert_bytes / 2**20:.2f} MiB; C={rt.capacity}/{rt.num_experts}; tier {rt.offload.tier}"
        f"{', io=' + rt.offload.io if rt.offload.tier == 'disk' else ''}; {rt.offload.readers} reader threads; "
        f"prefetch {rt.offload.prefetch}; torch threads {torch.get_num_threads()}; plan "
        f"{rt.plan.total / 2**20:.0f} MiB")
    freq = None
    if any(pset[n][0].policy in NEEDS_PROFILE for n in names):  # an activation profile from an original-routing
        # run (ERAS biasing needs one)
        from expertcache.sim import activation_frequency

        rt.configure(routing=RoutingConfig(), eviction="lru", record=True)
        rt.generate(prompt_BS, tokens, forced_BN=forced_BN)
        freq = activation_frequency(rt.recorded_ids_TLK(), rt.num_experts)
        rt.configure(record=False)
    rows = []
    for rep in range(repeats):
        bw = measure_bandwidth(rt, n=16, seed=rep)
        bw_serial = measure_bandwidth(rt, n=16, seed=rep + 1000, parallel=False)
        log(f"  [{rep + 1}/{repeats}] bandwidth {bw / 1e6:.0f} MB/s with {rt.readers.readers} readers, "
            f"{bw_serial / 1e6:.0f} MB/s serial")
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            routing, eviction = pset[name]
            rt.configure(routing=routing, eviction=eviction, freq_LE=freq if routing.policy in NEEDS_PROFILE else None)
            prefetched = prefetch(rt) if prefetch is not None else 0
            r = rt.generate(prompt_BS, tokens, forced_BN=forced_BN)
            s = r["decode_stats"]
            n = max(1, r["decode_tokens"])
            per_tok = r["decode_s"] / n
            t_compute = max(0.0, r["decode_s"] - s["io_wait_seconds"]) / n
            bytes_tok = s["bytes_read"] / n
            floor = max(t_compute, bytes_tok / bw)
            serial = t_compute + bytes_tok / bw_serial
            pf = rt.stats()["prefetch"]
            row = dict(kind="offload-bench", name=name, repeat=rep, tokens=n, batch=int(prompt_BS.shape[0]),
                       prompt_tokens=int(prompt_BS.shape[1]), forced=forced_BN is not None,
                       tok_s=n * prompt_BS.shape[0] / r["decode_s"],
                       s_per_token=per_tok, hit_rate=s["hit_rate"], misses_per_token=s["misses"] / n,
                       # the three ways a routed expert is served: full-precision hit, low-precision compute
                       # (--resident-quant), load (= misses)
                       fp_hits_per_token=s["hits"] / n, low_computes_per_token=s["low_computes"] / n,
                       # every decode-time expert load plus the --predictor prefetch loads made for this sequence
                       transfers_per_token=(s["misses"] + prefetched) / n,
                       bytes_per_token=bytes_tok, io_s_per_token=s["io_seconds"] / n,
                       io_wait_s_per_token=s["io_wait_seconds"] / n, t_compute=t_compute,
                       floor_s_per_token=floor, floor_ratio=per_tok / floor, serial_s_per_token=serial,
                       serial_ratio=per_tok / serial, bandwidth=bw, serial_bandwidth=bw_serial,
                       prefetch_precision=pf["precision"], prefetch_recall=pf["recall"],
                       prefetch_unused_bytes=pf["unused_bytes"],
                       prefetch_per_layer={str(i): v for i, v in pf["per_layer"].items()},
                       threads=torch.get_num_threads(), device=str(rt.device),
                       config=rt.describe(), machine=machine_info(),
                       prefetched=prefetched)
            rows.append(row)
            if on_row is not None:
                on_row(row)
            log(f"  [{rep + 1}/{repeats}] {name:<15} {row['tok_s']:8.2f} tok/s  hit {s['hit_rate']:.3f}  "
                f"{bytes_tok / 2**20:8.1f} MiB/token  compute {t_compute * 1e3:.1f} ms  floor {floor * 1e3:.1f} ms  "
                f"measured/floor {row['floor_ratio']:.2f}")
    summary = []
    for name in names:
        rs = [r for r in rows if r["name"] == name]
        med = {k: statistics.median(r[k] for r in rs) for k in
               ("tok_s", "s_per_token", "hit_rate", "misses_per_token", "fp_hits_per_token", "low_computes_per_token",
                "transfers_per_token", "bytes_per_token",
                "t_compute",
                "floor_s_per_token", "floor_ratio", "serial_s_per_token", "serial_ratio", "bandwidth",
                "serial_bandwidth", "io_wait_s_per_token")}
        for k in ("prefetch_precision", "prefetch_recall"):
            vals = [r[k] for r in rs if r[k] is not None]
            med[k] = statistics.median(vals) if vals else None
        summary.append(dict(name=name, routing=pset[name][0].label(), eviction=pset[name][1], **med))
    base = next((s for s in summary if s["name"] == "original+lru"), None)
    for s in summary:
        s["speedup_vs_lru"] = s["tok_s"] / base["tok_s"] if base else None
    return dict(summary=summary, rows=rows, config=rt.describe())


def table(result: dict) -> str:
    """Markdown table of a :func:`run_bench` result (medians)."""
    lines = ["| policy | routing | tok/s | × original+LRU | hit rate | MiB read/token | ms/token | compute ms/token | "
             "floor ms/token | measured/floor | serial ms/token | measured/serial | prefetch P / R | "
             "transfers/token (misses + prefetch loads) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result["summary"]:
        sp = "" if s["speedup_vs_lru"] is None else f"{s['speedup_vs_lru']:.2f}"
        pr = "–" if s["prefetch_precision"] is None else f"{s['prefetch_precision']:.2f} / {s['prefetch_recall']:.2f}"
        lines.append(f"| {s['name']} | {s['routing']}+{s['eviction']} | {s['tok_s']:.2f} | {sp} | {s['hit_rate']:.3f} | "
                     f"{s['bytes_per_token'] / 2**20:.1f} | {s['s_per_token'] * 1e3:.1f} | {s['t_compute'] * 1e3:.1f} | "
                     f"{s['floor_s_per_token'] * 1e3:.1f} | {s['floor_ratio']:.2f} | {s['serial_s_per_token'] * 1e3:.1f} | "
                     f"{s['serial_ratio']:.2f} | {pr} | {s['transfers_per_token']:.2f} |")
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


def teacher_forced_logits(rt: OffloadedModel, ids_S: torch.Tensor):
    """The next-token logits [V] after each of ``ids_S``'s positions, token by token through ``rt`` (a fresh KV
    cache: a prefill of the first token, then one decode step per token; each token's routing sees the live
    residency, and the expert caches carry on from whatever ran before)."""
    logits_BV, past = rt.prefill(ids_S[None, :1])  # rt.forward runs in inference mode
    yield logits_BV[0]
    for t in range(1, len(ids_S)):
        logits_BV, past = rt.decode_one_token(ids_S[None, t:t + 1], past)
        yield logits_BV[0]


def closed_loop_nll(rt: OffloadedModel, chunks_NS: torch.Tensor) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens scored) of every chunk's positions after the first, token by token
    through ``rt`` (:func:`teacher_forced_logits`; the caches carried across chunks)."""
    nll, count = 0.0, 0
    for chunk_S in chunks_NS:
        for t, logits_V in enumerate(teacher_forced_logits(rt, chunk_S[:-1]), 1):
            nll -= torch.log_softmax(logits_V.float(), -1)[chunk_S[t]].item()
            count += 1
    return nll, count


def closed_loop_last_logits(rt: OffloadedModel, ids: list[int]) -> torch.Tensor:
    """The next-token logits [V] after the whole prompt ``ids``, fed token by token (:func:`teacher_forced_logits`)."""
    for logits_V in teacher_forced_logits(rt, torch.as_tensor(ids, dtype=torch.long)):
        pass
    return logits_V


def closed_loop_mmlu(rt: OffloadedModel, task, on_question=lambda i, correct: None) -> dict:
    """An MMLU task (:class:`expertcache.eval.tasks.MMLUTask`: its prompts, its scoring ``task.score``) with
    every prompt fed token by token through ``rt`` (:func:`closed_loop_last_logits`), in order, the expert
    caches carried across questions. Returns ``predictions`` (answer index 0-3 per question), ``correct`` and
    ``mean_answer_loglik`` (log-probability of the right letter); ``on_question(i, correct so far)`` after each."""
    predictions, correct, loglik = [], 0, 0.0
    for i, (ids, answer) in enumerate(zip(task.prompts, task.answers)):
        predicted, logp = task.score(closed_loop_last_logits(rt, ids), answer)
        predictions.append(predicted)
        correct += int(predicted == answer)
        loglik += logp
        on_question(i, correct)
    return dict(predictions=predictions, correct=correct, mean_answer_loglik=loglik / max(1, len(predictions)))


def heldout_stream(path, max_docs: int = 4000) -> np.ndarray:
    """Token stream of the held-out split of the training corpus (see expertcache.train.data)."""
    from expertcache.train.data import encode_stream, load_documents, resolve_data_dir, split_documents
    from expertcache.train.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    _, held = split_documents(load_documents(resolve_data_dir(), max_docs=max_docs))
    return encode_stream(tok, [d["text"] for d in held[:64]], tok.eos_token_id)
