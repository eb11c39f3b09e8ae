"""Where a decode token's time goes: runs ``expertcache generate`` (same argv) with every expert warmed first
(``OffloadedModel.warm()``, so C = N decodes with no misses; WARM=0 keeps the cold start) and, from decode step
SKIP on (default 4), either per-module wall-clock timers (PROF=time, default; inclusive ms per token of each
module: attention, its int8 projections, the MoE block, the router (stock gate + routing policy), the cache step
``serve`` and the expert kernels ``qmm`` inside it, norms, lm_head, ...) or torch.profiler (PROF=torch: self CPU
per aten op; SHAPES=1 by input shape; adds ~4 ms/token of its own) or PROF=count (aten ops dispatched per token, by the
innermost timed module). Experiments, not defaults: ATTN32=1 runs the
one-query decode attention in float32 (q, k, v cast; bf16 out); ROUTER32=1 the OLMoE router's linear in float32
(a cached float32 copy of its weight); CATS=1 times every torch.cat by caller.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_decode_breakdown.py generate "The quick brown fox" \
        --model /work/peers/L8 --quant q4 --policy cache-prior --threads 1 --memory 3GiB --max-new-tokens 64

Results (8-layer OLMoE shape, AMD EPYC, 1 thread): docs/OFFLOAD.md "Where a decode token's time goes".
"""
import os, sys, time, json, collections
import torch
import expertcache.offload.runtime as R
import expertcache.offload.step as S
import expertcache.offload.routes as RO
from expertcache.cli.main import main

MODE = os.environ.get("PROF", "time")
SKIP = os.environ.get("SKIP", "4")
if MODE not in ("time", "torch", "count") or not SKIP.isdigit():  # one line and exit 2, before the model is loaded
    print(f"bench_decode_breakdown: PROF must be time, torch or count (got {MODE!r}) and SKIP a step count (got {SKIP!r})",
          file=sys.stderr)
    sys.exit(2)
SKIP = int(SKIP)
acc = collections.defaultdict(float)
cnt = collections.defaultdict(int)
on = [False]

stack = ["(outside modules)"]
ops = collections.defaultdict(int)
if MODE == "count":  # aten ops dispatched per token, by the innermost timed module they ran in
    from torch.utils._python_dispatch import TorchDispatchMode
    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if on[0]:
                ops[(stack[-1], str(func.overloadpacket))] += 1
            return func(*args, **(kwargs or {}))
    _Count().__enter__()

def timed(fn, name):
    def w(*a, **k):
        if not on[0]:
            return fn(*a, **k)
        if MODE == "count":
            stack.append(name)
            try:
                return fn(*a, **k)
            finally:
                stack.pop()
        if MODE == "torch":
            with torch.profiler.record_function("R:" + name):
                return fn(*a, **k)
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t
            cnt[name] += 1
    return w

S.CacheSteps.serve = timed(S.CacheSteps.serve, "serve(experts+book)")
S.CacheSteps._requests = timed(S.CacheSteps._requests, "serve._requests")
S.CacheSteps._book = timed(S.CacheSteps._book, "serve._book")
RO.Routes.route = timed(RO.Routes.route, "route_policy")

if os.environ.get("CATS"):
    _cat = torch.cat
    catacc = collections.defaultdict(float); catcnt = collections.defaultdict(int)
    def cat(*a, **k):
        if not on[0]:
            return _cat(*a, **k)
        f = sys._getframe(1)
        key = f"{f.f_code.co_filename.split('/')[-1]}:{f.f_lineno} {tuple(t.shape) if hasattr(t,'shape') else ''}" if False else f"{f.f_code.co_filename.split('site-packages/')[-1]}:{f.f_lineno} {[tuple(t.shape) for t in a[0]][:3]} {a[0][0].dtype}"
        t = time.perf_counter()
        r = _cat(*a, **k)
        catacc[key] += time.perf_counter() - t; catcnt[key] += 1
        return r
    torch.cat = cat
    import atexit
    def dump():
        n = len(step_times)
        for k in sorted(catacc, key=lambda k: -catacc[k])[:15]:
            print(f"CAT {k[:150]} {catacc[k]/n*1e3:.3f} ms/tok calls/tok {catcnt[k]/n:.1f}", file=sys.stderr)
    atexit.register(dump)
import expertcache.offload.quant as Q
Q.qmm = timed(Q.qmm, "qmm(expert kernels)")
if os.environ.get("ATTN32"):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    _sd = ALL_ATTENTION_FUNCTIONS["sdpa"]
    def sd32(module, q, k, v, mask, **kw):
        if q.dtype == torch.bfloat16 and q.shape[-2] == 1:
            o, w = _sd(module, q.float(), k.float(), v.float(), mask if mask is None or mask.dtype == torch.bool else mask.float(), **kw)
            return o.to(q.dtype), w
        return _sd(module, q, k, v, mask, **kw)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sd32
    import transformers.models.olmoe.modeling_olmoe as MO
    if "sdpa" in getattr(MO, "ALL_ATTENTION_FUNCTIONS", {}):
        MO.ALL_ATTENTION_FUNCTIONS["sdpa"] = sd32
if os.environ.get("ROUTER32"):
    import transformers.models.olmoe.modeling_olmoe as MO
    import torch.nn.functional as F
    def rfwd(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        w32 = getattr(self, "_w32", None)
        if w32 is None:
            w32 = self._w32 = self.weight.float()
        router_logits = F.linear(hidden_states.float(), w32).to(hidden_states.dtype)
        router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        return router_logits, router_top_value.to(router_logits.dtype), router_indices
    MO.OlmoeTopKRouter.forward = rfwd
orig_gen = R.generate
step_times = []
def gen(start, n, **kw):
    def start2():
        logits, step, c = start()
        i = [0]
        prof = [None]
        def step2(tok):
            if i[0] == SKIP:
                on[0] = True
                if MODE == "torch":
                    prof[0] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=bool(os.environ.get('SHAPES')), with_stack=bool(os.environ.get('STACK')))
                    prof[0].__enter__()
            i[0] += 1
            t = time.perf_counter()
            out = step(tok)
            if on[0]:
                step_times.append(time.perf_counter() - t)
            return out
        def comp():
            if prof[0] is not None:
                prof[0].__exit__(None, None, None)
                ka = prof[0].key_averages()
                n = len(step_times)
                rows = sorted(ka, key=lambda e: -e.self_cpu_time_total)
                print(f"\n== torch.profiler over {n} steps: self CPU ms/token (top) ==", file=sys.stderr)
                if os.environ.get('SHAPES'):
                    for e in sorted(prof[0].key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)[:30]:
                        print(f"{e.key[:40]:40s} {str(e.input_shapes)[:110]:110s} self {e.self_cpu_time_total/1e3/n:7.3f} calls/tok {e.count/n:6.1f}", file=sys.stderr)
                if os.environ.get('STACK'):
                    for e in sorted(prof[0].key_averages(group_by_stack_n=6), key=lambda e: -e.self_cpu_time_total)[:12]:
                        print(f"STK {e.key} self {e.self_cpu_time_total/1e3/n:7.3f} calls/tok {e.count/n:6.1f}", " | ".join(e.stack[:6]), file=sys.stderr)
                big = ("aten::_weight_int4pack_mm_for_cpu", "quantized::linear_dynamic", "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::mm")
                tot = sum(e.self_cpu_time_total for e in rows)/1e3/n
                rself = sum(e.self_cpu_time_total for e in rows if e.key.startswith("R:"))/1e3/n
                bigs = sum(e.self_cpu_time_total for e in rows if e.key in big)/1e3/n
                print(f"SUM self all {tot:.2f}  R:(python glue in ranges) {rself:.2f}  big kernels {bigs:.2f}  other aten ops {tot-rself-bigs:.2f} ms/tok", file=sys.stderr)
                for e in rows[:45]:
                    print(f"{e.key[:60]:60s} self {e.self_cpu_time_total/1e3/n:7.3f}  total {e.cpu_time_total/1e3/n:7.3f}  calls/tok {e.count/n:6.1f}", file=sys.stderr)
            return c()
        return logits, step2, comp
    return orig_gen(start2, n, **kw)
R.generate = gen

orig_rtgen = R.OffloadedModel.generate
def rtgen(self, *a, **k):
    if os.environ.get("WARM", "1") == "1":
        self.warm()
    m = self.model
    for name, mod in m.named_modules():
        leaf = name.split(".")[-1]
        lab = None
        if leaf == "self_attn": lab = "attn"
        elif leaf == "mlp": lab = "moe_block"
        elif leaf == "gate" and ".mlp." in name + ".": lab = "router_gate"
        elif leaf == "experts": lab = "experts_module"
        elif "norm" in leaf: lab = "norm:" + ("qk" if leaf in ("q_norm", "k_norm") else leaf if leaf == "norm" else "layer")
        elif leaf == "lm_head": lab = "lm_head"
        elif leaf == "embed_tokens": lab = "embed"
        elif leaf in ("q_proj", "k_proj", "v_proj", "o_proj"): lab = "attn_proj"
        elif leaf == "rotary_emb": lab = "rotary"
        elif name == "model": lab = "model(body)"
        if lab:
            mod.forward = timed(mod.forward, lab)
    if os.environ.get("SHOW"):
        print(m, file=sys.stderr)
    return orig_rtgen(self, *a, **k)
R.OffloadedModel.generate = rtgen

rc = 0
try:
    rc = main()
finally:
    n = len(step_times)
    if n:
        tot = sum(step_times) / n * 1e3
        print(f"\n== {MODE}: {n} decode steps, step mean {tot:.2f} ms (median {sorted(step_times)[n//2]*1e3:.2f}) ==", file=sys.stderr)
        if MODE == "count":
            by = collections.defaultdict(int)
            for (lab, op), c in ops.items():
                by[lab] += c
            print(f"aten ops per token: {sum(by.values()) / n:.0f}", file=sys.stderr)
            for lab in sorted(by, key=lambda l: -by[l]):
                top = sorted(((c, op) for (l, op), c in ops.items() if l == lab), reverse=True)[:8]
                print(f"{lab:28s} {by[lab] / n:7.1f} ops/tok  " + ", ".join(f"{op.split('.')[-1]} {c / n:.0f}" for c, op in top), file=sys.stderr)
        if MODE == "time":
            for k in sorted(acc, key=lambda k: -acc[k]):
                print(f"{k:28s} {acc[k]/n*1e3:8.3f} ms/tok  calls/tok {cnt[k]/n:6.1f}", file=sys.stderr)
sys.exit(rc)
