"""Quantised experts (and dense weights) on torch's fused kernels: the per-expert kernel time and the decode speed
with every expert resident (C = N, host tier), OLMoE-1B-7B shapes.

    nice -n 10 python benchmarks/bench_quant.py [--layers 4] [--tokens 16] [--repeats 3] [--threads 1]
        [--only kernel|decode|quality|logits] [--configs bf16 int8 int4 int4+dense-int8 ...]

1. **kernel**: one OLMoE-1B-7B expert, one token (gate_up [2048, 2048], down [2048, 1024]): the runtime's bf16
   path (two ``torch.mv``), format 1's int4 path (the codes dequantised to bf16 in torch on every use, then
   ``mv``: what ``--quant int4`` did before the fused kernels), and the fused ``_weight_int8pack_mm`` /
   ``_weight_int4pack_mm_for_cpu`` on the packed blob. Competitors interleaved, ``--repeats`` rounds, medians.
2. **decode**: the random-weight OLMoE-1B-7B-shape checkpoint with ``--layers`` layers
   (``expertcache bench --make-model olmoe-1b-7b --layers 4``), every expert resident (C = N = 64, warmed: no
   read during decode), ``--tokens`` teacher-forced tokens after a 16-token prompt; each quantised
   configuration is held in memory beside the bf16 one and their decode steps alternate token by token
   (the order alternating), ``--repeats`` rounds, the median of the per-round ratios. A config's ``@k`` forces the
   int4 experts' product (``$EXPERTCACHE_EXPERT_KERNEL``), ``@dense-k`` the int4 dense part's
   (``$EXPERTCACHE_DENSE_INT4_KERNEL``: ``int4+dense-int4@dense-q4x8``, ``q4m@dense-int4pack``).

3. **quality**: closed-loop perplexity of the shipped models (``granular``, ``coarse``) on WikiText-2 test
   (``--chunks`` chunks of 256 tokens, default 2 from /work/shared/data, the caches carried across chunks), every
   expert precision (bf16 / int8 / int4) × dense precision (none / int8 / int4) × routing (original,
   Cache-Prior λ 0.2), through the offloaded runtime token by token (teacher-forced decode: each token's routing
   sees the live residency of a C = N/2 LRU cache, as in BENCHMARKS.md's quality section).

4. **logits**: the ``--layers``-layer OLMoE-1B-7B-shape checkpoint's logits with int8 / int4 experts × dense
   none / int8 / int4 against the bf16 model (the runtime, unquantised, bf16) over 32 teacher-forced positions
   (a 16-token prompt, then 16 one-token decode steps): the largest absolute error, the relative L2 error and the
   top-1 agreement; a float32-compute row gives the bf16 rounding floor. One configuration in memory at a time
   (C = 16 slots a layer, reads page-cached). Random weights: each MoE layer's output is only 4-5 % of the
   residual stream's norm here (N(0, 0.02) matrices under std-1 embeddings; attention 35-40 %), so the experts'
   error reaches the logits diluted; tests/test_quant_olmoe.py checks a checkpoint where they weigh a third.

5. **kl** (``--only kl``): like ``llama-perplexity --kl-divergence``: the shipped ``--models`` (default granular) on
   held-out WikiText-2 test text (``--kl-chunks`` chunks of 256 tokens, default 16), the same token ids for every
   setting, each chunk one teacher-forced forward with every expert resident (C = N, original routing): the
   perplexity, its change against the unquantised model, the mean and 99th-percentile KL divergence
   KL(P_ref || P_q) of the next-token distributions against it, the top-1 agreement, and the bits per weight
   counted over all weights (every stored byte -- experts with their scales and padding, the dense part, norms,
   router; with tied embeddings both quantised copies -- over the checkpoint's parameters). Settings:
   ``KL_CONFIGS`` (int4 experts alone, + int8 / int4 dense, each int4 optimiser, the ``q4`` preset).

6. **startup** (``--only startup``): time to the first token of the ``--layers``-layer OLMoE-1B-7B-shape checkpoint
   with ``--quant int4 --quant-dense int4``, each start a fresh process (page cache warm): a cold start (no expert
   sidecar, no packed dense file), a start with the sidecar but not the dense file (the dense part packed again:
   every start before the dense cache), and a second start (both read). ``--repeats`` rounds.

Writes rows to benchmarks/results/quant.jsonl (``--out``) and prints markdown tables with ratios against bf16
measured in the same rounds.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from expertcache.offload import OffloadConfig, OffloadedModel
from expertcache.offload.bench import closed_loop_nll, machine_info
from expertcache.offload.make_model import make_bench_model
from expertcache.offload.qlinear import DENSE_INT8_KERNEL_VAR
from expertcache.offload.quant import DENSE_INT4_KERNEL_VAR, EXPERT_KERNEL_VAR, QuantLayout, pack_expert, quant_mlp
from expertcache.results import append_jsonl

OUT = Path(__file__).resolve().parent / "results" / "quant.jsonl"
CONFIGS = {  # name -> (expert quant, dense quant)
    "bf16": (None, None), "int8": ("int8", None), "int4": ("int4", None),
    "int8+dense-int8": ("int8", "int8"), "int4+dense-int8": ("int4", "int8"), "int4+dense-int4": ("int4", "int4"),
    "q4": ("q4", None),
    # the int4 experts' product forced ($EXPERTCACHE_EXPERT_KERNEL; the plain names take the CPU's own choice)
    **{f"{q}@{k}": (q, None) for q in ("int4", "q4") for k in ("int4pack", "fbgemm", "q4x8")},
    # the int4 dense part's product forced ($EXPERTCACHE_DENSE_INT4_KERNEL; the experts keep the CPU's own choice)
    "q4m": ("q4m", None),
    **{f"{c}@dense-{k}": (q, d) for c, q, d in (("int4+dense-int4", "int4", "int4"), ("q4m", "q4m", None))
       for k in ("int4pack", "q4x8")},
}
#: name suffix ``@k`` forces the experts' product, ``@dense-k`` the int4 dense part's (read while a runtime is built)
_FORCE = {"": EXPERT_KERNEL_VAR, "dense-": DENSE_INT4_KERNEL_VAR}


def _mean_us(fn, n: int) -> float:
    """Mean CPU time of the calling thread per call (µs): one torch thread computes on it, and a busy machine's
    time slicing does not count (its cache and memory-bandwidth contention still does)."""
    for _ in range(3):
        fn()
    t0 = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t0) / n * 1e6


def _format1_int4(w_NK: torch.Tensor, group: int):
    """Format 1's int4 expert matrix (min/scale per group of ``group``, two codes a byte) and its per-use
    dequantisation to bf16 (main before the fused kernels: offload/quant.py ``dequantize_matrix``)."""
    w = w_NK.float().reshape(-1, group)
    lo, hi = w.amin(1), w.amax(1)
    s = ((hi - lo) / 15).half()
    m = lo.half()
    q = torch.round((w - m.float()[:, None]) / s.float().clamp(min=2 ** -24)[:, None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(-1)
    packed = q[0::2] | (q[1::2] << 4)
    shape = tuple(w_NK.shape)

    def dequant():
        q_N = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)
        return (q_N.reshape(-1, group).to(torch.bfloat16) * s.to(torch.bfloat16)[:, None]
                + m.to(torch.bfloat16)[:, None]).reshape(shape)
    return dequant


def kernel_rows(repeats: int, n: int = 50) -> list[dict]:
    d, f = 2048, 1024
    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(2 * f, d, generator=g) * 0.02).bfloat16()
    down = (torch.randn(d, f, generator=g) * 0.02).bfloat16()
    x = torch.randn(1, d, generator=g).bfloat16()
    act = torch.nn.functional.silu

    def bf16():
        gate, up = torch.mv(gu, x[0]).chunk(2)
        return torch.mv(down, act(gate) * up)

    deq_gu, deq_down = _format1_int4(gu, 64), _format1_int4(down, 64)

    def format1():
        gate, up = torch.mv(deq_gu(), x[0]).chunk(2)
        return torch.mv(deq_down(), act(gate) * up)

    comps = {"bf16 mv": bf16, "format-1 int4 (dequantise per use)": format1}
    for mode in ("int8", "int4"):
        layout = QuantLayout(mode, d, f, 64, torch.bfloat16)
        views = layout.views(pack_expert(gu.float(), down.float(), layout))
        mlp = quant_mlp(layout, act)
        comps[f"fused {mode}"] = (lambda mlp=mlp, views=views: mlp(x, views))
    times = {k: [] for k in comps}
    for _ in range(repeats):
        for k, fn in comps.items():  # interleaved
            times[k].append(_mean_us(fn, n))
    return [dict(kind="quant-kernel", what=k, us=statistics.median(v), us_rounds=v, d=d, f=f) for k, v in times.items()]


def _runtime(path, name: str, tokens: int) -> OffloadedModel:
    """Every expert resident (C = N), warmed: no read during decode (checked by the rows' ``misses``). The tier
    is the disk with page-cached reads: with every expert in a slot the decode step is the host tier's, and no
    second host copy of the experts takes memory."""
    quant, dense = CONFIGS[name]
    kernel = name.partition("@")[2]
    var = _FORCE["dense-" if kernel.startswith("dense-") else ""]
    kernel = kernel.removeprefix("dense-")
    saved = os.environ.get(var)
    if kernel:  # only while it is built: its slots' views and MLPs (and its QuantLinears) choose the product then
        os.environ[var] = kernel
    try:
        rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="disk", io="cached", readers=0, quant=quant,
                                                                quant_dense=dense, context=16 + tokens))
    finally:
        if kernel:
            os.environ.pop(var) if saved is None else os.environ.__setitem__(var, saved)
    rt.warm(range(rt.num_experts))
    t0 = time.perf_counter()
    rt.steps.drain()
    for st in rt.states:  # FBGEMM's per-slot copies made now (the runtime makes each at the expert's first use)
        for e, slot in st.pool.slot_of.items():
            rt.views.weights(st.moe.index, e, slot)
    rt.prepack_seconds = time.perf_counter() - t0
    return rt


def decode_rows(layers: int, tokens: int, repeats: int, configs: list[str], log) -> list[dict]:
    """Each configuration against bf16 in pairs held in memory together, decode steps interleaved token by
    token (the order alternating), so the machine's load changes both sides of a ratio alike."""
    path = make_bench_model("olmoe-1b-7b", layers=layers)
    prompt = torch.randint(3, 50304, (1, 16), generator=torch.Generator().manual_seed(0))
    forced = torch.randint(3, 50304, (1, tokens), generator=torch.Generator().manual_seed(1))
    base = _runtime(path, "bf16", tokens)
    rows = []
    for name in [c for c in configs if c != "bf16"]:
        rt = _runtime(path, name, tokens)
        for r in range(repeats):
            pair = {"bf16": base, name: rt}
            secs = {k: [] for k in pair}
            cpu = {k: [] for k in pair}
            moe = {k: 0.0 for k in pair}
            with torch.inference_mode():
                state = {k: m.prefill(prompt) for k, m in pair.items()}
                m0 = {k: m.stats() for k, m in pair.items()}
                for t in range(tokens):
                    for k in (list(pair) if t % 2 == 0 else list(pair)[::-1]):
                        t0, c0 = time.perf_counter(), time.thread_time()
                        state[k] = pair[k].decode_one_token(forced[:, t:t + 1], state[k][1])
                        secs[k].append(time.perf_counter() - t0)
                        cpu[k].append(time.thread_time() - c0)
            for k, m in pair.items():
                s = m.stats()
                row = dict(kind="quant-decode", config=k, vs=name, round=r, layers=layers, tokens=tokens,
                           decode_tok_s=tokens / sum(secs[k]), median_token_s=statistics.median(secs[k]),
                           cpu_tok_s=tokens / sum(cpu[k]), median_token_cpu_s=statistics.median(cpu[k]),
                           moe_compute_s=(s["compute_seconds"] - m0[k]["compute_seconds"]) / tokens,
                           misses=s["misses"] - m0[k]["misses"], expert_bytes=m.expert_bytes,
                           non_expert_bytes=m.plan.non_expert_bytes, quant_kernel=m.describe()["quant_kernel"],
                           expert_kernel=None if m.views.quant is None else
                           "fbgemm" if m.views.prepack is not None else
                           "q4x8" if m.views.quant.kernel == "q4x8" else "int4pack",
                           dense_kernel=m.describe().get("dense_kernel"),
                           views_seconds=getattr(m, "prepack_seconds", None), slot_bytes=m.plan.slot_bytes,
                           threads=torch.get_num_threads())
                rows.append(row)
            a, b = rows[-2], rows[-1]
            log(f"round {r} {name} vs bf16: {b['decode_tok_s']:.2f} vs {a['decode_tok_s']:.2f} tok/s = "
                f"{b['decode_tok_s'] / a['decode_tok_s']:.2f}x wall, {b['cpu_tok_s']:.2f} vs {a['cpu_tok_s']:.2f} = "
                f"{b['cpu_tok_s'] / a['cpu_tok_s']:.2f}x thread CPU time (MoE layers {b['moe_compute_s'] * 1e3:.0f} vs "
                f"{a['moe_compute_s'] * 1e3:.0f} ms/token; misses {a['misses']}, {b['misses']})")
        rt.close()
        del rt, pair
        gc.collect()
    return rows


def quality_rows(models: list[str], chunks: int, log, on_row, seq: int = 256) -> list[dict]:
    import math

    from tokenizers import Tokenizer

    from expertcache.eval.data import resolve_eval_data_dir, wikitext_text
    from expertcache.models.loader import resolve_model_path
    from expertcache.routing import RoutingConfig

    text = wikitext_text(resolve_eval_data_dir("wikitext"))
    rows = []
    streams = {}
    for model in models:
        path = resolve_model_path(model)
        ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text, add_special_tokens=False).ids
        streams[model] = (path, torch.tensor(ids[:chunks * seq]).view(chunks, seq))
    for dense in ("none", "int8", "int4"):  # the rows the targets need first
        for model, (path, chunks_NS) in streams.items():
            for experts in ("bf16", "int8", "int4"):
                q = None if experts == "bf16" else experts
                rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", quant=q, context=seq,
                                                                        quant_dense=None if dense == "none" else dense))
                for routing in (RoutingConfig(), RoutingConfig(policy="cache-prior", lam=0.2)):
                    rt.configure(routing=routing, capacity=rt.num_experts // 2)
                    t0 = time.perf_counter()
                    nll, count = closed_loop_nll(rt, chunks_NS)
                    s = rt.stats()
                    row = dict(kind="quant-quality", model=model, experts=experts, dense=dense,
                               routing=routing.label(), capacity=rt.capacity, num_experts=rt.num_experts,
                               ppl=math.exp(nll / count), tokens=count, miss_rate=s["misses"] / max(1, s["accesses"]),
                               expert_bytes=rt.expert_bytes, non_expert_bytes=rt.plan.non_expert_bytes,
                               group=rt.offload.group, seconds=time.perf_counter() - t0)
                    log(f"{model} experts={experts} dense={dense} {row['routing']}: ppl {row['ppl']:.2f}, "
                        f"miss rate {row['miss_rate']:.3f} ({row['seconds']:.0f} s)")
                    rows.append(row)
                    on_row(row)
                rt.close()
    return rows


#: name -> OffloadConfig fields, for ``--only kl``
KL_CONFIGS = {
    "int4": dict(quant="int4"), "int4 hqq": dict(quant="int4", quant_opt="hqq"),
    "int4 lsq": dict(quant="int4", quant_opt="lsq"),
    "int4 + dense int8": dict(quant="int4", quant_dense="int8"),
    "int4 + dense int4": dict(quant="int4", quant_dense="int4"),
    "int4 lsq + dense int4 lsq": dict(quant="int4", quant_dense="int4", quant_opt="lsq"),
    "int4 hqq + dense int8": dict(quant="int4", quant_dense="int8", quant_opt="hqq"),
    "q4": dict(quant="q4"),
    "q4, dense int8 weight-only": dict(quant="q4", dense_int8_kernel="int8pack"),
    "q4, dense int8 q8x8": dict(quant="q4", dense_int8_kernel="q8x8"),
    "q4m": dict(quant="q4m"),
    # q4m's int8 lm_head weight-only (bf16 activations) or on q8x8 (int8 per 32 activations: its AVX2 default)
    **{f"q4m, lm_head {k}": dict(quant="q4m", dense_int8_kernel=k) for k in ("int8pack", "q8x8")},
    "int8 + dense int8": dict(quant="int8", quant_dense="int8"),
    # the int4 experts' product forced (the plain names take the CPU's own choice: BENCHMARKS.md "Which 4-bit kernel")
    **{f"{q}@{k}": dict(quant=q, expert_kernel=k) for q in ("int4", "q4") for k in ("int4pack", "fbgemm", "q4x8")},
}


def kl_rows(models: list[str], chunks: int, configs: list[str], log, on_row, seq: int = 256,
            text_source: str = "heldout") -> list[dict]:
    """Each setting against the unquantised model on the same token ids (module docstring, 5). ``text_source``:
    ``heldout`` (the held-out split of the training corpus, expertcache.train.data) or ``wikitext``."""
    import math

    from expertcache.models.loader import resolve_model_path
    from expertcache.eval.data import text_token_chunks
    from expertcache.offload.checkpoint import read_header
    from expertcache.offload.kernelnote import kernel_choice_line

    rows = []
    for model in models:
        path = resolve_model_path(model)
        try:
            chunks_NS = text_token_chunks(path, text_source, chunks, seq)
        except ValueError as exc:
            raise ValueError(f"{model}: {exc}") from None
        params = sum(math.prod(e.shape) for f in sorted(path.glob("*.safetensors")) for e in read_header(f).values())

        def run(dense_int8_kernel=None, expert_kernel=None, **kw):
            t0 = time.perf_counter()
            forced = {v: k for v, k in ((DENSE_INT8_KERNEL_VAR, dense_int8_kernel), (EXPERT_KERNEL_VAR, expert_kernel))
                      if k is not None}  # read while the runtime is built (a kernel the CPU's choice would not take)
            saved = {v: os.environ.get(v) for v in forced}
            os.environ.update(forced)
            try:
                rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", context=seq, **kw))
            finally:
                for v, old in saved.items():
                    os.environ.pop(v) if old is None else os.environ.__setitem__(v, old)
            with torch.inference_mode():
                logp = torch.stack([torch.log_softmax(rt.forward(c[None]).logits[0].float(), -1) for c in chunks_NS])
            d = rt.describe()
            info = dict(bpw=8 * (rt.expert_bytes * len(rt.layers) * rt.num_experts + rt.plan.non_expert_bytes) / params,
                        quant_kernel=d.get("quant_kernel"), dense_kernel=d.get("dense_kernel"), quant_opt=d["quant_opt"],
                        expert_kernel=None if rt.views.quant is None else
                        "fbgemm" if rt.views.prepack is not None else
                        "q4x8" if rt.views.quant.kernel == "q4x8" else "int4pack",
                        kernels=kernel_choice_line(rt.offload.quant, rt.offload.quant_dense, norms=rt.host_norms), group=rt.offload.group,
                        expert_bytes=rt.expert_bytes, non_expert_bytes=rt.plan.non_expert_bytes)
            rt.close()
            gc.collect()
            return logp, info, time.perf_counter() - t0

        ref, ref_info, secs = run()  # [chunks, S, V]
        tgt = chunks_NS[:, 1:]
        ref_nll = -ref[:, :-1].gather(-1, tgt[..., None]).mean().item()
        log(f"{model}: unquantised ppl {math.exp(ref_nll):.3f}, {ref_info['bpw']:.2f} bits/weight ({secs:.0f} s)")
        for name in configs:
            got, info, secs = run(**KL_CONFIGS[name])
            nll = -got[:, :-1].gather(-1, tgt[..., None]).mean().item()
            kl = (ref.exp() * (ref - got)).sum(-1).flatten()  # KL(P_ref || P_q) per position
            row = dict(kind="quant-kl", model=model, config=name, settings=KL_CONFIGS[name], chunks=chunks, seq=seq,
                       text=text_source,
                       tokens=int(tgt.numel()), ppl=math.exp(nll), ppl_ref=math.exp(ref_nll),
                       ppl_change=math.exp(nll - ref_nll) - 1, kl_mean=kl.mean().item(),
                       kl_p99=kl.quantile(0.99).item(), top1_agree=(got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                       bpw_ref=ref_info["bpw"], params=params, seconds=secs, threads=torch.get_num_threads(), **info)
            log(f"{model} {name}: ppl {row['ppl']:.3f} ({100 * row['ppl_change']:+.2f} %), KL {row['kl_mean']:.5f} "
                f"(p99 {row['kl_p99']:.4f}), top-1 {row['top1_agree']:.3f}, {row['bpw']:.2f} bits/weight ({secs:.0f} s)")
            rows.append(row)
            on_row(row)
    return rows


LOGIT_CONFIGS = [(q, d) for q in ("int8", "int4") for d in (None, "int8", "int4")]


def _forced_logits(rt: OffloadedModel, prompt_BS: torch.Tensor, forced_BN: torch.Tensor) -> torch.Tensor:
    """Logits [B, S + N, V] (float32) of every position, teacher-forced: the prompt's S from one prefill, then one
    per one-token decode step feeding ``forced_BN``'s N tokens."""
    from transformers import DynamicCache

    with torch.inference_mode():
        out = rt.forward(prompt_BS, DynamicCache(config=rt.config))
        logits, past = [out.logits.float()], out.past_key_values
        for t in range(forced_BN.shape[1]):
            out = rt.forward(forced_BN[:, t:t + 1], past)
            logits.append(out.logits.float())
            past = out.past_key_values
    return torch.cat(logits, dim=1)


def logits_rows(layers: int, log, on_row, capacity: int = 16) -> list[dict]:
    """Each quantised configuration's logits against the unquantised bf16 runtime's, one model in memory at a
    time; plus the unquantised model in float32 against bf16 (what bf16 rounding alone moves)."""
    path = make_bench_model("olmoe-1b-7b", layers=layers)
    prompt = torch.randint(3, 50304, (1, 16), generator=torch.Generator().manual_seed(0))
    forced = torch.randint(3, 50304, (1, 16), generator=torch.Generator().manual_seed(1))

    def run(quant, dense, dtype):
        t0 = time.perf_counter()
        rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="disk", io="cached", readers=0, quant=quant,
                                                                quant_dense=dense, capacity=capacity, context=64),
                                            dtype=dtype)
        got = _forced_logits(rt, prompt, forced)[0]  # [32, V]
        info = dict(expert_bytes=rt.expert_bytes, non_expert_bytes=rt.plan.non_expert_bytes,
                    quant_kernel=rt.describe().get("quant_kernel"), group=rt.offload.group)
        rt.close()
        del rt
        gc.collect()
        return got, info, time.perf_counter() - t0

    base, _, secs = run(None, None, torch.bfloat16)
    log(f"bf16 reference: {base.shape[0]} positions ({secs:.0f} s)")
    rows = []
    for quant, dense, dtype in [*((q, d, torch.bfloat16) for q, d in LOGIT_CONFIGS), (None, None, torch.float32)]:
        got, info, secs = run(quant, dense, dtype)
        err = (got.double() - base.double())
        row = dict(kind="quant-logits", layers=layers, experts=quant or "bf16", dense=dense or "none",
                   compute=str(dtype).removeprefix("torch."), positions=base.shape[0], capacity=capacity,
                   max_abs_err=err.abs().max().item(), max_abs_logit=base.abs().max().item(),
                   rel_l2_err=(err.norm() / base.double().norm()).item(),
                   top1_agree=(got.argmax(-1) == base.argmax(-1)).float().mean().item(),
                   threads=torch.get_num_threads(), seconds=secs, **info)
        log(f"experts={row['experts']} dense={row['dense']} {row['compute']}: max |err| {row['max_abs_err']:.3f} "
            f"(max |logit| {row['max_abs_logit']:.2f}), rel L2 {row['rel_l2_err']:.4f}, top-1 "
            f"{row['top1_agree']:.3f} ({secs:.0f} s)")
        rows.append(row)
        on_row(row)
    return rows


_STARTUP_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from expertcache.offload import OffloadConfig, OffloadedModel
torch.set_num_threads(1)
t1 = time.perf_counter()
rt = OffloadedModel.from_pretrained(sys.argv[1], OffloadConfig(tier="disk", io="cached", readers=0, quant="int4",
                                                               quant_dense="int4", capacity=8, context=64))
t2 = time.perf_counter()
with torch.inference_mode():
    rt.generate(torch.arange(3, 19)[None], max_new_tokens=1)
t3 = time.perf_counter()
print(json.dumps(dict(import_s=t1 - t0, load_s=t2 - t1, first_token_s=t3 - t2, ttft_s=t3 - t0,
                      dense_load=rt.describe()["dense_load"])))
"""


def startup_rows(layers: int, repeats: int, log, on_row) -> list[dict]:
    """Time to the first token, each start a fresh process (module docstring, 6)."""
    import os
    import shutil
    import subprocess

    from expertcache.offload.loader import cache_dir

    path = make_bench_model("olmoe-1b-7b", layers=layers)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    dense_dir = cache_dir() / "dense"
    rows = []

    def start(kind):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", _STARTUP_CHILD, str(path)], env=env, check=True,
                             stdout=subprocess.PIPE, text=True).stdout
        r = dict(json.loads(out.strip().splitlines()[-1]), kind="quant-startup", start=kind, layers=layers,
                 wall_s=time.perf_counter() - t0)
        log(f"{kind}: time to first token {r['ttft_s']:.1f} s (imports {r['import_s']:.1f}, loading {r['load_s']:.1f}, "
            f"first token {r['first_token_s']:.1f}; dense {r['dense_load'].get('dense_cache')} in "
            f"{r['dense_load'].get('seconds', 0):.1f} s)")
        on_row(r)
        rows.append(r)

    import json
    for r in range(repeats):
        for side in [*path.glob("expertcache-experts-*.safetensors"), *(cache_dir() / "quant").glob(f"{path.name}-*")]:
            side.unlink()
        shutil.rmtree(dense_dir, ignore_errors=True)
        start("cold")
        shutil.rmtree(dense_dir, ignore_errors=True)
        start("sidecar, dense packed")
        start("second")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", choices=("kernel", "decode", "quality", "logits", "kl", "startup"), default=None)
    ap.add_argument("--kl-chunks", type=int, default=16, help="kl: chunks of 256 tokens")
    ap.add_argument("--kl-text", choices=("heldout", "wikitext"), default="heldout",
                    help="kl: the models' held-out corpus split, or WikiText-2 test")
    ap.add_argument("--kl-configs", nargs="+", choices=list(KL_CONFIGS), default=list(KL_CONFIGS))
    ap.add_argument("--chunks", type=int, default=2, help="quality: WikiText chunks of 256 tokens")
    ap.add_argument("--models", nargs="+", default=["granular", "coarse"], help="quality: shipped models")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    from expertcache.results import check_rows_out

    check_rows_out(ap, args.out)  # rows go to a row file only: never appended to notes.md
    for flag, value in (("--layers", args.layers), ("--tokens", args.tokens), ("--repeats", args.repeats),
                        ("--threads", args.threads), ("--chunks", args.chunks), ("--kl-chunks", args.kl_chunks)):
        if value < 1:  # --repeats 0: a traceback (StopIteration / median of nothing) after the set-up
            ap.error(f"{flag} must be ≥ 1, got {value}")
    from expertcache.offload.runtime import resolve_model_path

    for name in args.models:  # named before any work: a model that is not there
        try:
            resolve_model_path(name)
        except (FileNotFoundError, ValueError) as exc:
            ap.error(str(exc))
    torch.set_num_threads(args.threads)
    info = machine_info()
    with open("/proc/loadavg") as f:
        info["loadavg"] = f.read().split()[:3]
    print(f"machine: {info}", flush=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = lambda row: append_jsonl(args.out, dict(row, bench="bench_quant.py", machine=info, date=stamp))
    if args.only in (None, "kernel"):
        rows = kernel_rows(args.repeats)
        base = next(r["us"] for r in rows if r["what"] == "bf16 mv")
        print("\n| one OLMoE expert, one token | µs thread CPU time (median) | × bf16 |\n|---|---:|---:|")
        for r in rows:
            out(r)
            print(f"| {r['what']} | {r['us']:.0f} | {base / r['us']:.2f} |")
    if args.only in (None, "decode"):
        rows = decode_rows(args.layers, args.tokens, args.repeats, args.configs, lambda *a: print(*a, flush=True))
        for r in rows:
            out(r)
        print(f"\n| C = N, {args.layers} layers, pairs interleaved per token | tok/s (CPU time) | bf16 (same rounds) | "
              f"× bf16 (median of {args.repeats} rounds; wall-clock) | MoE layers ms/token (wall) |\n|---|---:|---:|---:|---:|")
        for c in [c for c in args.configs if c != "bf16"]:
            mine = [r for r in rows if r["config"] == c]
            theirs = [r for r in rows if r["config"] == "bf16" and r["vs"] == c]
            ratio = statistics.median(a["cpu_tok_s"] / b["cpu_tok_s"] for a, b in zip(mine, theirs))
            wall = statistics.median(a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(mine, theirs))
            print(f"| {c} | {statistics.median(r['cpu_tok_s'] for r in mine):.2f} | "
                  f"{statistics.median(r['cpu_tok_s'] for r in theirs):.2f} | {ratio:.2f} ({wall:.2f}) | "
                  f"{statistics.median(r['moe_compute_s'] for r in mine) * 1e3:.0f} vs "
                  f"{statistics.median(r['moe_compute_s'] for r in theirs) * 1e3:.0f} |")
    if args.only in (None, "logits"):
        rows = logits_rows(args.layers, lambda *a: print(*a, flush=True), out)
        print(f"\n| OLMoE-1B-7B shapes, {args.layers} layers: experts | dense | compute | max abs error | relative L2 "
              f"error | top-1 agreement ({rows[0]['positions']} positions) |\n|---|---|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['experts']} | {r['dense']} | {r['compute']} | {r['max_abs_err']:.3f} | "
                  f"{r['rel_l2_err']:.4f} | {r['top1_agree']:.3f} |")
    if args.only in (None, "startup"):
        rows = startup_rows(args.layers, args.repeats, lambda *a: print(*a, flush=True), out)
        print(f"\n| {args.layers}-layer OLMoE-1B-7B shape, int4 + dense int4 | time to first token, s (median of "
              f"{args.repeats}) | of which dense weights, s |\n|---|---:|---:|")
        for kind in ("cold", "sidecar, dense packed", "second"):
            mine = [r for r in rows if r["start"] == kind]
            print(f"| {kind} | {statistics.median(r['ttft_s'] for r in mine):.1f} | "
                  f"{statistics.median(r['dense_load'].get('seconds', 0) for r in mine):.1f} |")
    if args.only in (None, "kl"):
        models = args.models if "--models" in (argv or sys.argv) else ["granular"]
        rows = kl_rows(models, args.kl_chunks, args.kl_configs, lambda *a: print(*a, flush=True), out,
                       text_source=args.kl_text)
        print(f"\n| model ({args.kl_text}) | setting | bits/weight | ppl | Δ ppl | mean KL | p99 KL | top-1 |\n"
              "|---|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['model']} | {r['config']} | {r['bpw']:.2f} | {r['ppl']:.3f} | {100 * r['ppl_change']:+.2f} % | "
                  f"{r['kl_mean']:.5f} | {r['kl_p99']:.4f} | {r['top1_agree']:.3f} |")
    if args.only in (None, "quality"):
        rows = quality_rows(args.models, args.chunks, lambda *a: print(*a, flush=True), out)
        print("\n| model | experts | dense | routing | ppl | vs bf16/none | miss rate |\n|---|---|---|---|---:|---:|---:|")
        for r in rows:
            base = next(b["ppl"] for b in rows if b["model"] == r["model"] and b["routing"] == r["routing"]
                        and b["experts"] == "bf16" and b["dense"] == "none")
            print(f"| {r['model']} | {r['experts']} | {r['dense']} | {r['routing']} | {r['ppl']:.2f} | "
                  f"{100 * (r['ppl'] / base - 1):+.2f} % | {r['miss_rate']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
