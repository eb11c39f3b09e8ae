"""Which 4-bit kernel on which CPU: one-token (M = 1) products ``x @ W.T`` of the OLMoE-1B-7B expert and dense
shapes with every CPU candidate torch (and torchao, where it installs) offers, on each ISA torch can dispatch to.

    OMP_NUM_THREADS=1 python benchmarks/bench_kernels.py [--isa avx2 avx512] [--rounds 5] [--shapes ...]
        [--kernels NAME ...] [--compile] [--out benchmarks/results/kernels.jsonl]

Each ``--isa`` runs in a child process with the ISA capped in each of torch's three kernel libraries (they pick
their kernels once, at start-up, each from its own variable): ``avx2`` sets ``ATEN_CPU_CAPABILITY=avx2`` (ATen's
own kernels: the int4/int8 packs), ``ONEDNN_MAX_CPU_ISA=AVX2`` (bf16 ``linear``, ``_int_mm``) and
``FBGEMM_ENABLE_INSTRUCTIONS=AVX2`` (the dynamic int8 linear); ``default`` sets none (AVX-512 with VNNI and
bf16 here). ATEN_CPU_CAPABILITY alone leaves oneDNN and FBGEMM on AVX-512: bf16 ``linear`` then measured
317 µs instead of 216 µs and FBGEMM 78 µs instead of 97 µs on the expert's down matrix, so an AVX2 row needs
all three. An AVX-512 machine measures both. One thread. Every candidate of a shape is timed in the same
rounds, interleaved (``--rounds``, medians of the per-call thread CPU time). Weights are **cold**: each
candidate cycles through enough distinct copies of its matrix to pass 96 MiB (the L3 is 32 MiB here), so a call
reads its weights from memory as a decode step does (64 experts a layer, 16 layers), not from the cache.

Candidates (``W`` float32 N(0, 0.02), ``x`` N(0, 1)):

- ``bf16 linear``: ``F.linear`` on bf16 (the runtime's unquantised path);
- ``int4pack G=g``: ``_weight_int4pack_mm_for_cpu`` (bf16 x, int4 asymmetric groups of g; what
  ``--quant int4`` and ``--quant-dense int4`` use: offload/quant.py);
- ``int8pack``: ``_weight_int8pack_mm`` (bf16 x, int8 per output channel: ``--quant int8``);
- ``a8w8 fbgemm``: ``quantized.linear_dynamic`` (float32 x quantised per call to uint8, int8 weight per channel,
  FBGEMM's VNNI/AVX2 kernels; torch.ao's deprecated dynamic-quantisation path);
- ``a8w8 _int_mm``: x quantised per token to int8 in torch, ``torch._int_mm`` (int8 × int8 -> int32, oneDNN),
  scaled back;
- ``a8w4 dyn_quant_matmul_4bit``: ``_dyn_quant_matmul_4bit`` (int8 activation × int4 symmetric groups of 32:
  KleidiAI on ARM, a reference path on x86);
- ``a8w8 q8x8``: expertcache's int8 dense product on AVX2 (offload/q8x8.py: activations 8-bit per 32 values);
- ``q4x8 G=g``: expertcache's own int8-activation × int4 kernel (offload/q4x8.py, numba: AVX2 ``vpmaddubsw``
  intrinsics; what the int4 experts run on AVX2 CPUs); ``--isa avx2`` also sets ``NUMBA_CPU_NAME=haswell`` and
  ``NUMBA_CPU_FEATURES=+avx2,+fma`` so numba compiles it for AVX2 only (rows: ``numba_cpu_name``,
  ``numba_cpu_features``, ``q4x8_path``);
- ``inductor dequant-mm G=32`` (``--compile``): the int4 codes as bytes (two a byte), dequantised and reduced in
  one ``torch.compile``-generated C++ kernel (float32 accumulation);
- torchao: its CPU int4 weight-only layout (``Int4WeightOnlyConfig(int4_packing_format="opaque")``) calls the
  same ``_weight_int4pack_mm_for_cpu``; its x86 int8-activation × int4 kernels (``da8w4``) are not in the PyPI
  wheel (``torch.ops.torchao`` has no CPU linear there), so torchao adds no row (recorded in each row's
  ``torchao`` field).

Rows: benchmarks/results/kernels.jsonl with the CPU model, its flags that matter, torch's capability and the
relative error against float32.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

OUT = Path(__file__).resolve().parent / "results" / "kernels.jsonl"
#: name -> (N, K): the OLMoE-1B-7B expert's gate_up and down, an attention projection, lm_head
SHAPES = {"expert gate_up": (2048, 2048), "expert down": (2048, 1024), "attn q/k/v/o": (2048, 2048),
          "lm_head": (50304, 2048)}
COLD_BYTES = 96 << 20
#: what caps each of torch's kernel libraries at an ISA (module docstring)
ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"},
           "avx512": {"ATEN_CPU_CAPABILITY": "avx512"}, "default": {}}
# numba (the q4x8 kernel) compiles for AVX2 only: the target CPU and its features (with the name alone numba keeps
# the host's features, AVX-512 included)
ISA_ENV["avx2"].update(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="+avx2,+fma")


def numba_info() -> dict:
    """The q4x8 kernel's numba target (``NUMBA_CPU_NAME``, unset: this CPU) and its path (AVX2 intrinsics or plain)."""
    from expertcache.offload import q4x8

    return dict(numba_cpu_name=os.environ.get("NUMBA_CPU_NAME") or "host",
                numba_cpu_features=os.environ.get("NUMBA_CPU_FEATURES") or "host",
                q4x8_path=("avx2" if q4x8.use_avx2() else "plain") if q4x8.available() else None)


def cpu_info() -> dict:
    """The CPU model, the ISA flags that choose kernels, what torch dispatches to and the ISA caps set."""
    from expertcache.offload.quant import cpu_description

    return dict(cpu_description(), torch=torch.__version__)


def _int4_codes(w: torch.Tensor, group: int):
    from expertcache.offload.quant import quantize_codes
    return quantize_codes(w, "int4", group, torch.bfloat16)


def cand_bf16(w, x):
    wb = w.bfloat16()
    return (lambda W, xx=x.bfloat16(): F.linear(xx, W)), wb, wb.nbytes


def cand_int4pack(group):
    def make(w, x):
        from expertcache.offload.quant import QuantMatrix, kernel_for, pack_matrix, qmm
        qm = QuantMatrix("int4", kernel_for("int4"), w.shape[0], w.shape[1], group, torch.bfloat16)
        pw, sz = pack_matrix(w, qm)
        return (lambda W, xx=x.bfloat16(): qmm(xx, W[0], W[1], qm)), (pw, sz), pw.nbytes + sz.nbytes
    return make


def cand_q4x8(group):
    def make(w, x):
        from expertcache.offload.quant import QuantMatrix, pack_matrix, qmm
        qm = QuantMatrix("int4", "q4x8", w.shape[0], w.shape[1], group, torch.bfloat16)
        pw, sz = pack_matrix(w, qm)
        return (lambda W, xx=x.bfloat16(): qmm(xx, W[0], W[1], qm)), (pw, sz), pw.nbytes + sz.nbytes
    return make


def cand_int8pack(w, x):
    from expertcache.offload.quant import quantize_codes
    q, s, _ = quantize_codes(w, "int8", 0, torch.bfloat16)
    q = q.to(torch.int8)
    return (lambda W, xx=x.bfloat16(): torch.ops.aten._weight_int8pack_mm(xx, W[0], W[1])), (q, s), q.nbytes + s.nbytes


def cand_q8x8(w, x):
    from expertcache.offload import q8x8
    from expertcache.offload.quant import quantize_codes
    q, s, _ = quantize_codes(w, "int8", 0, torch.bfloat16)
    q = q.to(torch.int8).contiguous()
    return (lambda W, xx=x.bfloat16(): q8x8.q8x8_mm(xx, W[0], W[1])), (q, s), q.nbytes + s.nbytes


def cand_fbgemm(w, x):
    s = (w.abs().amax(1) / 127).double()
    qw = torch.quantize_per_channel(w, s, torch.zeros_like(s, dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    return (lambda W, xx=x.float(): torch.ops.quantized.linear_dynamic(xx, W, True)), packed, qw.int_repr().nbytes


def cand_int_mm(w, x):
    s_w = w.abs().amax(1) / 127
    q_KN = torch.round(w / s_w[:, None]).clamp(-127, 127).to(torch.int8).t().contiguous()

    def run(W, xx=x.float()):
        s_x = xx.abs().amax(-1, keepdim=True) / 127
        q = torch.round(xx / s_x).to(torch.int8)
        return torch._int_mm(q, W[0]).float() * s_x * W[1]
    return run, (q_KN, s_w), q_KN.nbytes


def cand_dyn4(w, x):
    n, k, g = w.shape[0], w.shape[1], 32
    w_g = w.reshape(n, k // g, g)
    s = w_g.abs().amax(-1) / 7
    q = (torch.round(w_g / s[..., None]).clamp(-8, 7) + 8).to(torch.int32).reshape(n, k)
    u8 = ((q[:, 1::2] << 4) | q[:, ::2]).to(torch.uint8)
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight(u8, s, None, g, k, n)
    return (lambda W, xx=x.float(): torch.ops.aten._dyn_quant_matmul_4bit(xx, W, g, k, n)), packed, packed.nbytes


_COMPILED = {}


def cand_inductor(w, x):
    group = 32
    n, k = w.shape
    q, s, z = _int4_codes(w, group)
    u8 = (q[:, ::2] | (q[:, 1::2] << 4)).to(torch.uint8)  # [N, K/2]
    if "f" not in _COMPILED:
        def deq_mm(x_1K, u8_NH, s_NB, z_NB):
            lo, hi = (u8_NH & 15).float(), (u8_NH >> 4).float()
            q_NK = torch.stack([lo, hi], dim=-1).reshape(u8_NH.shape[0], -1)  # [N, K]
            w_NBG = (q_NK.view(q_NK.shape[0], s_NB.shape[1], -1) - 8) * s_NB.float()[..., None] + \
                z_NB.float()[..., None]
            return (w_NBG.reshape(q_NK.shape) * x_1K.float()).sum(-1)[None].to(x_1K.dtype)
        _COMPILED["f"] = torch.compile(deq_mm, dynamic=False, fullgraph=True)
    f = _COMPILED["f"]
    return (lambda W, xx=x.bfloat16(): f(xx[0], *W)), (u8, s, z), u8.nbytes + s.nbytes + z.nbytes


def candidates(compile_: bool) -> dict:
    out = {"bf16 linear": cand_bf16, "int4pack G=32": cand_int4pack(32), "int4pack G=64": cand_int4pack(64),
           "int4pack G=128": cand_int4pack(128), "int8pack": cand_int8pack, "a8w8 fbgemm": cand_fbgemm,
           "a8w8 _int_mm": cand_int_mm, "a8w4 dyn_quant_matmul_4bit": cand_dyn4}
    from expertcache.offload import q4x8
    if q4x8.available():
        out.update({"q4x8 G=32": cand_q4x8(32), "q4x8 G=64": cand_q4x8(64), "a8w8 q8x8": cand_q8x8})
    if compile_:
        out["inductor dequant-mm G=32"] = cand_inductor
    return out


def _torchao_note() -> str:
    try:
        import torchao  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"not importable ({type(e).__name__})"
    cpu_ops = [o for o in dir(torch.ops.torchao) if "cpu" in o or "da8w4" in o]
    return f"torchao {torchao.__version__}: CPU linear ops {cpu_ops or 'none'} (int4 CPU layout = _weight_int4pack_mm_for_cpu)"


def child(args) -> list[dict]:
    torch.set_num_threads(1)
    info = cpu_info()
    note = _torchao_note()
    rows = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        g = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=g) * 0.02
        x = torch.randn(1, k, generator=g)
        ref = F.linear(x, w)
        comps, pools, errs = {}, {}, {}
        for name, make in candidates(args.compile).items():
            if args.kernels and not any(name.startswith(k) for k in args.kernels):
                continue
            try:
                fn, weights, nbytes = make(w, x)
                y = fn(weights).float()
            except Exception as e:  # noqa: BLE001 - a candidate this torch/CPU lacks is reported, not fatal
                print(f"[{info['aten_capability']}] {shape} {name}: unavailable ({type(e).__name__}: "
                      f"{str(e).splitlines()[0][:120]})", file=sys.stderr, flush=True)
                continue
            copies = max(1, min(64, -(-COLD_BYTES // max(1, nbytes))))
            pool = [weights]
            for c in range(1, copies):  # distinct copies (same values: the timing does not depend on them)
                pool.append(make(w, x)[1] if name.startswith(("a8w8 fbgemm", "a8w4")) else
                            _clone(weights))
            comps[name], pools[name] = (fn, nbytes), pool
            errs[name] = ((y - ref).norm() / ref.norm()).item()
        times = {name: [] for name in comps}
        for r in range(args.rounds):
            for name, (fn, _) in comps.items():  # interleaved
                pool = pools[name]
                calls = max(len(pool) * 2, 8)
                for i in range(4):
                    fn(pool[i % len(pool)])
                t0 = time.thread_time()
                for i in range(calls):
                    fn(pool[i % len(pool)])
                times[name].append((time.thread_time() - t0) / calls * 1e6)
        base = statistics.median(times["bf16 linear"]) if "bf16 linear" in times else None
        for name, ts in times.items():
            us = statistics.median(ts)
            row = dict(kind="kernel-survey", shape=shape, n=n, k=k, m=1, kernel=name, us=us, us_rounds=ts,
                       vs_bf16=(base / us) if base else None, weight_bytes=comps[name][1],
                       copies=len(pools[name]), rel_err=errs[name], threads=1, torchao=note, **info,
                       **(numba_info() if name.startswith("q4x8") else {}))
            rows.append(row)
            print(f"[{info['aten_capability']}] {shape} {name}: {us:.0f} µs ({row['vs_bf16']:.2f}x bf16), "
                  f"rel err {errs[name]:.4f}", file=sys.stderr, flush=True)
    return rows


def _clone(w):
    if isinstance(w, torch.Tensor):
        return w.clone()
    return tuple(t.clone() for t in w)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", nargs="+", choices=list(ISA_ENV), default=["avx2", "default"],
                    help="one child each, its kernel libraries capped at that ISA ('default': uncapped)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--compile", action="store_true", help="add the inductor-generated dequant-matmul")
    ap.add_argument("--kernels", nargs="+", default=None,
                    help="only the candidates whose names start with these (bf16 linear is the baseline: name it)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    from expertcache.results import append_jsonl, check_rows_out

    check_rows_out(ap, args.out)  # rows go to a row file only: refused before the work, never appended to notes.md
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows = []
    for isa in args.isa:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for var in ISA_ENV["avx2"]:
            env.pop(var, None)
        env.update(ISA_ENV.get(isa, {}))
        cmd = [sys.executable, __file__, "--child", "--rounds", str(args.rounds), "--shapes", *args.shapes] + \
            (["--compile"] if args.compile else []) + (["--kernels", *args.kernels] if args.kernels else [])
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, check=True, text=True).stdout
        for row in json.loads(out.strip().splitlines()[-1]):
            row.update(bench="bench_kernels.py", date=stamp)
            append_jsonl(args.out, row)
            rows.append(row)
    print("\n| ISA (torch) | shape [N, K] | kernel | µs (median) | × bf16 | rel. error |\n|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['aten_capability']} | {r['shape']} [{r['n']}, {r['k']}] | {r['kernel']} | {r['us']:.0f} | "
              f"{r['vs_bf16']:.2f} | {r['rel_err']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
