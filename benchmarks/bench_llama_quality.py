#!/usr/bin/env python
"""Quantisation quality like for like against llama.cpp (issue 45): one trained model that llama.cpp can quantise
(``granular-256``: every matrix row a multiple of 256, untied lm_head), the same token ids for every system.

    expertcache train --model granular-256 --steps 800 --lr 4e-3 --eval-every 200 --out runs/granular-256
    PYTHONPATH=<llama-cpp-python build> python benchmarks/bench_llama_quality.py --model runs/granular-256/model \\
        --vendor <llama-cpp-python sdist>/vendor/llama.cpp [--text heldout|wikitext] [--chunks 16] [--threads 1]

Reference: the model's logits computed by transformers in **float32** (its bf16 weights upcast); every system is
also compared with the same model computed in bf16 by transformers (``vs_bf16`` in the rows). Systems:

* ``torch-bf16``: transformers, bf16 compute (the bf16 rounding floor);
* ``ec-*``: expertcache's runtime with every expert resident (``OffloadConfig(tier="host")``, C = N, original
  routing), one forward per chunk: bf16, ``--quant int8``, ``int4``, int4 with int8 / int4 dense part, the ``q4``
  preset (``EC_SYSTEMS``);
* ``llama-*``: llama.cpp through llama-cpp-python (``Llama(gguf, n_ctx=256, logits_all=True)``; ``reset``,
  ``eval(ids)``, ``scores``: the logits of every position; its default f16 KV cache; without its CPU "extra"
  buffer types, ``--no-repack``: with them eval crashes on this AMX CPU): the checkpoint converted by
  llama.cpp's own ``convert_hf_to_gguf.py`` to BF16 and F16 (``bench_peers.py convert``), and quantised by its own
  quantiser from the BF16 file (``bench_peers.py quantize``) to Q8_0, Q4_K_M and Q4_0. The GGUFs are kept in
  ``--gguf-dir`` and made again when older than the checkpoint.

Text: ``--chunks`` non-overlapping chunks of 256 tokens of the held-out split of the training corpus (the
documents ``expertcache.train.data`` holds out; default) or of WikiText-2 test; each chunk one forward from an
empty context. Per system and reference: perplexity over the 255 predicted tokens of every chunk, its change
against the reference, mean / 99th-percentile / largest KL(P_ref ‖ P_sys) of the next-token distributions at
those positions (what ``llama-perplexity --kl-divergence`` reports), top-1 agreement, and bits per weight counted
over all weights: a GGUF's tensor bytes × 8 / the checkpoint's parameter count; expertcache's stored bytes of
every weight (experts with their scales, zeros and padding, the dense part, norms, router) × 8 / the same count.

Rows go to ``--out`` (benchmarks/results/llama_quality.jsonl); a markdown table is printed.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "llama_quality.jsonl"
SEQ = 256
#: name -> OffloadConfig fields
EC_SYSTEMS = {
    "ec-bf16": {}, "ec-int8": dict(quant="int8"), "ec-int4": dict(quant="int4"),
    "ec-int4+dense-int8": dict(quant="int4", quant_dense="int8"),
    "ec-int4+dense-int4": dict(quant="int4", quant_dense="int4"),
    "ec-q4": dict(quant="q4"), "ec-q4m": dict(quant="q4m"),
    # variants of the preset with the knobs the runtime has today (group size, dense precision)
    "ec-q4-g128": dict(quant="q4", group=128), "ec-q4+dense-int4": dict(quant="q4", quant_dense="int4"),
    "ec-q4-g128+dense-int4": dict(quant="q4", group=128, quant_dense="int4"),
}
#: simulated recipes (``sim-*``): each weight replaced by its dequantised codes (expertcache.offload.quant.quantize_codes)
#: in the bf16 transformers model -- weight error only, no activation quantisation -- to try per-tensor precisions
#: before the runtime has them. Parts: gate_up / down (experts), attn (q, k, o), attn_v, emb, head; values
#: ``bf16``, ``int8`` (per row) or ``int4/G/optimiser``; ``@L,L`` limits a part to those layers (later entries win).
SIM_RECIPES = {
    "sim-q4": "gate_up=int4/64/lsq down=int4/64/lsq attn=int8 attn_v=int8 emb=int8 head=int8",
    "sim-q4-dense4-head8": "gate_up=int4/64/lsq down=int4/64/lsq attn=int4/32/lsq attn_v=int4/32/lsq "
                           "emb=int4/32/lsq head=int8",
    "sim-q4-g128-emb4": "gate_up=int4/128/lsq down=int4/128/lsq attn=int8 attn_v=int8 emb=int4/64/lsq head=int8",
    "sim-q4km-like": "gate_up=int4/64/lsq down=int4/64/lsq attn=int4/64/lsq attn_v=int4/64/lsq emb=int4/64/lsq "
                     "head=int8 down@2,3=int8 attn_v@2,3=int8",
}
#: llama.cpp GGUFs: name -> (convert --outtype, or quantize --ftype of the BF16 file)
LLAMA_SYSTEMS = {"llama-BF16": ("bf16", None), "llama-F16": ("f16", None), "llama-Q8_0": (None, "Q8_0"),
                 "llama-Q4_K_M": (None, "Q4_K_M"), "llama-Q4_0": (None, "Q4_0")}
SYSTEMS = ("torch-bf16", *EC_SYSTEMS, *LLAMA_SYSTEMS, *SIM_RECIPES)

#: ggml tensor types: (weights per block, bytes per block) -- ggml's type traits (ggml.c ``type_traits``)
GGML_BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
               "Q5_1": (32, 24), "Q8_0": (32, 34), "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144),
               "Q5_K": (256, 176), "Q6_K": (256, 210), "Q8_K": (256, 292)}


# -- pure helpers ---------------------------------------------------------------------------------------------


def tensor_bytes(type_name: str, n: int) -> int:
    """Bytes of ``n`` weights stored as ggml type ``type_name`` (whole blocks; ValueError if ``n`` is not a
    multiple of the type's block or the type is unknown)."""
    if type_name not in GGML_BLOCKS:
        raise ValueError(f"unknown ggml type {type_name!r}")
    block, size = GGML_BLOCKS[type_name]
    if n % block:
        raise ValueError(f"{n} weights are not whole {type_name} blocks of {block}")
    return n // block * size


def bits_per_weight(tensors, params: int | None = None) -> float:
    """8 × the bytes of ``tensors`` (``(ggml type name, weights)`` pairs) / ``params`` (default: their weights)."""
    tensors = list(tensors)
    n = params if params is not None else sum(k for _, k in tensors)
    return 8 * sum(tensor_bytes(t, k) for t, k in tensors) / n


def compare(ref_CSV, got_CSV, ids_CS) -> dict:
    """Quality of ``got`` against ``ref``: both log-probabilities ``[chunks, S, V]`` of the next token at every
    position of ``ids_CS`` (each chunk from an empty context). Over the ``S - 1`` positions of a chunk that
    predict one of its tokens: perplexity of both, ``ppl_change`` = ppl / ppl_ref − 1, KL(P_ref ‖ P_got) per
    position (mean, 99th percentile (linear interpolation), largest) and the share of positions whose most likely
    token agrees. Computed in float64."""
    import torch

    ref = ref_CSV[:, :-1].double()
    got = got_CSV[:, :-1].double()
    tgt = ids_CS[:, 1:, None].long()
    nll_ref = -ref.gather(-1, tgt).mean().item()
    nll = -got.gather(-1, tgt).mean().item()
    kl = (ref.exp() * (ref - got)).sum(-1).flatten()
    return dict(ppl=math.exp(nll), ppl_ref=math.exp(nll_ref), ppl_change=math.exp(nll - nll_ref) - 1,
                kl_mean=kl.mean().item(), kl_p99=torch.quantile(kl, 0.99).item(), kl_max=kl.max().item(),
                top1_agree=(got.argmax(-1) == ref.argmax(-1)).double().mean().item(), positions=int(kl.numel()))


def parse_recipe(text: str) -> list[tuple[str, tuple[int, ...] | None, str]]:
    """``"part=prec part@L,L=prec ..."`` → [(part, layers or None, precision)] (ValueError naming a bad entry)."""
    out = []
    for entry in text.split():
        key, _, prec = entry.partition("=")
        part, _, layers = key.partition("@")
        if part not in RECIPE_PARTS or not _precision_ok(prec):
            raise ValueError(f"bad recipe entry {entry!r}")
        out.append((part, tuple(int(x) for x in layers.split(",")) if layers else None, prec))
    return out


RECIPE_PARTS = ("gate_up", "down", "attn", "attn_v", "emb", "head")


def _precision_ok(prec: str) -> bool:
    if prec in ("bf16", "int8"):
        return True
    bits, *rest = prec.split("/")
    return bits == "int4" and len(rest) == 2 and rest[0].isdigit() and rest[1] in ("minmax", "hqq", "lsq")


def param_part(name: str) -> tuple[str | None, int | None]:
    """(recipe part, layer) of a transformers OLMoE parameter name; (None, layer) for what stays bf16 (norms,
    router)."""
    layer = int(name.split(".layers.")[1].split(".")[0]) if ".layers." in name else None
    if name.endswith("embed_tokens.weight"):
        return "emb", None
    if name.startswith("lm_head."):
        return "head", None
    if ".experts.gate_up_proj" in name:
        return "gate_up", layer
    if ".experts.down_proj" in name:
        return "down", layer
    if ".self_attn." in name and name.endswith("_proj.weight"):
        return ("attn_v" if ".v_proj." in name else "attn"), layer
    return None, layer


def precision_of(recipe, part: str | None, layer: int | None) -> str:
    got = "bf16"
    for p, layers, prec in recipe:
        if p == part and (layers is None or layer in layers):
            got = prec
    return got


def stored_bits(prec: str, rows: int, k: int) -> int:
    """Bits of a [rows, k] matrix stored at ``prec`` as expertcache stores it: bf16; int8 codes + a bf16 scale per
    row; int4 codes + a bf16 scale and zero per group of G along k."""
    if prec == "bf16":
        return 16 * rows * k
    if prec == "int8":
        return rows * (8 * k + 16)
    g = int(prec.split("/")[1])
    return rows * (4 * k + 32 * (k // g))


# -- the systems ----------------------------------------------------------------------------------------------


def _logp(logits):
    import torch

    return torch.log_softmax(logits.float(), -1)


def torch_logp(path: Path, chunks_CS, dtype):
    """transformers' log-probabilities ``[C, S, V]`` (float32) with the model computed in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
    with torch.inference_mode():
        out = torch.stack([_logp(model(input_ids=c[None]).logits[0]) for c in chunks_CS])
    del model
    gc.collect()
    return out, {}


def ec_logp(path: Path, chunks_CS, params: int, **kw):
    import torch

    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.offload.kernelnote import kernel_choice_line

    rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", context=SEQ, **kw))
    with torch.inference_mode():
        out = torch.stack([_logp(rt.forward(c[None]).logits[0]) for c in chunks_CS])
    stored = rt.expert_bytes * len(rt.layers) * rt.num_experts + rt.plan.non_expert_bytes
    d = rt.describe()
    info = dict(bpw=8 * stored / params, stored_bytes=stored, expert_bytes=rt.expert_bytes,
                non_expert_bytes=rt.plan.non_expert_bytes, group=rt.offload.group, quant_opt=d.get("quant_opt"),
                quant_kernel=d.get("quant_kernel"), dense_kernel=d.get("dense_kernel"),
                kernels=kernel_choice_line(rt.offload.quant, rt.offload.quant_dense, norms=rt.host_norms))
    rt.close()
    del rt
    gc.collect()
    return out, info


def sim_logp(path: Path, chunks_CS, params: int, recipe_text: str):
    """The bf16 transformers model with each weight replaced by its dequantised ``recipe`` codes (SIM_RECIPES)."""
    import torch
    from transformers import AutoModelForCausalLM

    from expertcache.offload.quant import quantize_codes

    recipe = parse_recipe(recipe_text)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, local_files_only=True).eval()
    bits = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            prec = precision_of(recipe, *param_part(name)) if p.dim() >= 2 else "bf16"
            w = p.reshape(-1, p.shape[-1])
            bits += stored_bits(prec, *w.shape)
            if prec == "bf16":
                continue
            mode, *rest = prec.split("/")
            group, opt = (int(rest[0]), rest[1]) if rest else (0, "minmax")
            q, sc, z = quantize_codes(w.float(), mode, group, torch.bfloat16, optimize=opt)
            if mode == "int8":
                deq = q.float() * sc.float()[:, None]
            else:
                deq = ((q.float().view(w.shape[0], -1, group) - 8) * sc.float()[..., None] + z.float()[..., None])
            p.copy_(deq.reshape(p.shape).to(p.dtype))
    with torch.inference_mode():
        out = torch.stack([_logp(model(input_ids=c[None]).logits[0]) for c in chunks_CS])
    del model
    gc.collect()
    return out, dict(bpw=bits / params, stored_bytes=bits // 8, recipe=recipe_text, simulated=True)


def gguf_tensors(gguf: Path, vendor: Path | None) -> list[tuple[str, str, int, int]]:
    """(name, ggml type, weights, bytes) of every tensor of a GGUF (llama.cpp's gguf-py reader)."""
    try:
        import gguf as gguf_py
    except ImportError:
        sys.path.insert(0, str(Path(vendor) / "gguf-py"))
        import gguf as gguf_py
    reader = gguf_py.GGUFReader(str(gguf))
    return [(t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes)) for t in reader.tensors]


def llama_logp(gguf: Path, chunks_CS, params: int, threads: int, vendor: Path | None):
    import numpy as np
    import torch
    import llama_cpp

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_peers import no_repack

    no_repack(llama_cpp)  # its CPU extra buffer types (Q4/Q8 repacking, AMX) crash in eval here (segfault, 0.3.36)
    llm = llama_cpp.Llama(str(gguf), n_ctx=SEQ, n_batch=SEQ, n_ubatch=SEQ, logits_all=True, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    out = []
    for c in chunks_CS:
        llm.reset()
        llm.eval(c.tolist())
        out.append(_logp(torch.from_numpy(np.array(llm.scores[:len(c)], dtype=np.float32))))
    del llm
    gc.collect()
    tensors = gguf_tensors(gguf, vendor)
    for name, t, n, b in tensors:
        if t in GGML_BLOCKS and tensor_bytes(t, n) != b:  # the table above against the file
            raise RuntimeError(f"{gguf.name}: tensor {name} {t} × {n}: {b} bytes, table says {tensor_bytes(t, n)}")
    types: dict[str, int] = {}
    for _, t, n, _ in tensors:
        types[t] = types.get(t, 0) + n
    stored = sum(b for *_, b in tensors)
    return torch.stack(out), dict(bpw=8 * stored / params, stored_bytes=stored, gguf=gguf.name,
                                  gguf_weights=sum(n for _, _, n, _ in tensors), gguf_types=types,
                                  llama_cpp=llama_cpp.__version__, no_repack=True)


def make_gguf(system: str, model: Path, gguf_dir: Path, vendor: Path | None, log) -> Path:
    """The GGUF of ``system`` in ``gguf_dir`` (made with bench_peers.py's convert / quantize when missing or older
    than the checkpoint)."""
    outtype, ftype = LLAMA_SYSTEMS[system]
    name = system.removeprefix("llama-")
    path = gguf_dir / f"{model.name}-{name}.gguf"
    newest = max(f.stat().st_mtime for f in model.glob("*.safetensors"))
    if path.exists() and path.stat().st_mtime >= newest:
        return path
    gguf_dir.mkdir(parents=True, exist_ok=True)
    peers = [sys.executable, str(Path(__file__).resolve().parent / "bench_peers.py")]
    if ftype is None:
        cmd = [*peers, "convert", "--model", str(model), "--gguf", str(path), "--vendor", str(vendor),
               "--outtype", outtype]
    else:
        base = make_gguf("llama-BF16", model, gguf_dir, vendor, log)
        cmd = [*peers, "quantize", "--gguf", str(base), "--gguf-q4", str(path), "--ftype", ftype, "--threads", "1"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0 or not path.exists():
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}")
    from expertcache.outputs import record_names

    record_names(gguf_dir, [path.name], "bench_llama_quality")  # so that a later run may replace it, and only it
    log(f"made {path} ({path.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - t0:.0f} s)")
    return path


# -- main -----------------------------------------------------------------------------------------------------


def token_chunks(model: Path, text: str, chunks: int):
    """The first ``chunks`` × 256 token ids of the text, ``[chunks, 256]`` (ValueError if it is shorter)."""
    from expertcache.eval.data import text_token_chunks

    try:
        return text_token_chunks(model, text, chunks, SEQ)
    except ValueError as exc:
        raise ValueError(f"--chunks: {exc}") from None


def check_args(ap, a) -> None:
    """Every flag checked before the work: ``ap.error`` (one line, exit 2) naming the culprit."""
    from expertcache.results import check_rows_out

    check_rows_out(ap, a.out)
    for flag, value in (("--chunks", a.chunks), ("--threads", a.threads)):
        if value < 1:
            ap.error(f"{flag} must be ≥ 1, got {value}")
    model = Path(a.model)
    if not (model / "config.json").is_file() or not any(model.glob("*.safetensors")):
        ap.error(f"--model {a.model}: not a model folder (config.json and *.safetensors); make it with "
                 "`expertcache train --model granular-256 --steps 800 --lr 4e-3 --eval-every 200 "
                 "--out runs/granular-256` (the model is runs/granular-256/model)")
    llama = [s for s in a.systems if s in LLAMA_SYSTEMS]
    if not llama:
        return
    check_gguf_dir(ap, a, llama)
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        ap.error(f"--systems {' '.join(llama)}: llama-cpp-python is not importable ({exc})")
    if not (Path(a.vendor) / "convert_hf_to_gguf.py").is_file():
        ap.error(f"--vendor {a.vendor}: no convert_hf_to_gguf.py there (the vendor/llama.cpp folder of the "
                 "llama-cpp-python sdist)")


def gguf_dir_of(a) -> Path:
    """``--gguf-dir``, default ``<expertcache cache>/gguf``."""
    from expertcache.offload.loader import cache_dir

    return Path(a.gguf_dir).expanduser() if a.gguf_dir else cache_dir() / "gguf"


def check_gguf_dir(ap, a, llama: list[str]) -> None:
    """``--gguf-dir`` before the work (one line, exit 2): a folder (or none yet), not inside the input ``--model``
    folder, and every GGUF this run would make again there (missing or older than the checkpoint) either absent or
    one this script wrote (``outputs.claim_names``): a user's file of that name is never replaced."""
    from expertcache.outputs import OutputError, claim_names

    gdir, model = gguf_dir_of(a), Path(a.model)
    if gdir.exists() and not gdir.is_dir():
        ap.error(f"--gguf-dir {gdir}: not a folder")
    if gdir.resolve().is_relative_to(model.resolve()):
        ap.error(f"--gguf-dir {gdir}: inside the input --model folder {model}; give another --gguf-dir")
    names = {f"{model.name}-{s.removeprefix('llama-')}.gguf" for s in llama}
    if any(LLAMA_SYSTEMS[s][1] for s in llama):  # quantised from the BF16 file
        names.add(f"{model.name}-BF16.gguf")
    newest = max(f.stat().st_mtime for f in model.glob("*.safetensors"))
    stale = sorted(n for n in names if (gdir / n).exists() and (gdir / n).stat().st_mtime < newest)
    try:
        claim_names(gdir, stale, "--gguf-dir", "bench_llama_quality", {"--model": str(model)})
    except OutputError as exc:
        ap.error(str(exc))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the trained granular-256 model folder (see above)")
    ap.add_argument("--text", choices=("heldout", "wikitext"), default="heldout")
    ap.add_argument("--chunks", type=int, default=16, help="chunks of 256 tokens")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads")
    ap.add_argument("--vendor", default="", help="vendor/llama.cpp folder of the llama-cpp-python sdist "
                                                 "(llama.cpp's convert_hf_to_gguf.py and gguf-py)")
    ap.add_argument("--gguf-dir", default="", help="where the GGUFs are kept (default: <cache>/gguf)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    check_args(ap, a)
    import torch

    from expertcache.offload.bench import machine_info
    from expertcache.offload.checkpoint import read_header
    from expertcache.results import append_jsonl

    torch.set_num_threads(a.threads)
    model = Path(a.model).resolve()
    gguf_dir = gguf_dir_of(a)
    vendor = Path(a.vendor) if a.vendor else None
    try:
        chunks_CS = token_chunks(model, a.text, a.chunks)
    except (ValueError, FileNotFoundError) as exc:
        ap.error(str(exc))
    entries = [e for f in sorted(model.glob("*.safetensors")) for e in read_header(f).values()]
    params, ckpt_bytes = sum(math.prod(e.shape) for e in entries), sum(e.nbytes for e in entries)
    info = machine_info()
    info["loadavg"] = os.getloadavg()
    log = lambda *x: print(*x, flush=True)  # noqa: E731
    log(f"machine: {info}")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0 = time.perf_counter()
    ref, _ = torch_logp(model, chunks_CS, torch.float32)
    log(f"fp32 reference ({time.perf_counter() - t0:.0f} s)")
    ref_bf16, _ = torch_logp(model, chunks_CS, torch.bfloat16)
    rows = []
    for system in a.systems:
        t0 = time.perf_counter()
        if system == "torch-bf16":
            got, extra = ref_bf16, dict(bpw=8 * ckpt_bytes / params, stored_bytes=ckpt_bytes)  # the bf16 checkpoint
        elif system in SIM_RECIPES:
            got, extra = sim_logp(model, chunks_CS, params, SIM_RECIPES[system])
        elif system in EC_SYSTEMS:
            got, extra = ec_logp(model, chunks_CS, params, **EC_SYSTEMS[system])
        else:
            gguf = make_gguf(system, model, gguf_dir, vendor, log)
            got, extra = llama_logp(gguf, chunks_CS, params, a.threads, vendor)
        row = dict(kind="llama-quality", system=system, model=model.name, text=a.text, chunks=a.chunks, seq=SEQ,
                   params=params, **compare(ref, got, chunks_CS), vs_bf16=compare(ref_bf16, got, chunks_CS),
                   settings=EC_SYSTEMS.get(system), seconds=time.perf_counter() - t0, threads=a.threads, **extra)
        append_jsonl(a.out, dict(row, bench="bench_llama_quality.py", machine=info, date=stamp))
        rows.append(row)
        log(f"{system}: {row['bpw']:.2f} bits/weight, ppl {row['ppl']:.3f} ({100 * row['ppl_change']:+.2f} %), "
            f"KL {row['kl_mean']:.5f} (p99 {row['kl_p99']:.4f}), top-1 {row['top1_agree']:.3f}; vs bf16 KL "
            f"{row['vs_bf16']['kl_mean']:.5f} ({row['seconds']:.0f} s)")
    print(f"\n{model.name}, {a.text} text, {a.chunks} × {SEQ} tokens; reference: transformers float32 (ppl "
          f"{rows[0]['ppl_ref']:.3f})\n\n| system | bits/weight | ppl | Δ ppl | mean KL | p99 KL | top-1 | mean KL vs "
          "bf16 torch |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['system']} | {r['bpw']:.2f} | {r['ppl']:.3f} | {100 * r['ppl_change']:+.2f} % | "
              f"{r['kl_mean']:.5f} | {r['kl_p99']:.4f} | {r['top1_agree']:.3f} | {r['vs_bf16']['kl_mean']:.5f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
