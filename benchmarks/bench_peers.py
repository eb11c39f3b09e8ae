#!/usr/bin/env python
"""Peers side by side under a Linux memory cgroup (BENCHMARKS.md, "Decode speed against peers under a memory limit").

The same random-weight checkpoint (``expertcache bench --make-model olmoe-1b-7b --layers 16``) decoded by

* **expertcache** (``original+lru`` without and with prefetch, ``cache-prior`` λ = 0.5): ``--memory`` = limit − 0.5 GiB,
  O_DIRECT disk tier, 1 torch thread, 4 reader threads; ``ec-lru-pf`` adds next-layer prefetch (P = K spare slots
  shared by all layers, out of the budget; it runs without where they do not fit next to C = K); none for Cache-Prior (it misses too
  rarely to need it); ``ec-bench`` runs ``expertcache bench`` itself inside the cgroup;
* **llama.cpp** through ``llama-cpp-python`` on a bf16 GGUF conversion of the same weights (mmap, 1 thread), at
  the block device's default ``read_ahead_kb`` and at 128 KiB (restored afterwards, always); ``llama-q4``: the
  same on the **Q4_K_M** GGUF that llama.cpp's own quantiser makes of it (``quantize``), what llama.cpp's CPU
  users run; ``--no-repack`` loads without llama.cpp's CPU extra buffer types (its ``--no-repack``);
* **expertcache with 4-bit experts** (``ec-q4-lru``, ``ec-q4-cp``: ``--quant int4``; ``ec-q4d-*`` adds
  ``--quant-dense int4`` where the runtime has it; ``ec-q4p-lru``, ``ec-q4p-cp``: the ``--quant q4`` preset, ``ec-q4m-cp`` the ``q4m`` one,
  ``offload.quant.QUANT_PRESETS``); every expertcache child plans with ``--memory auto``
  inside its cgroup (``--ec-memory reserve``: the earlier rows' limit − 0.5 GiB);
* **HF accelerate** disk offload (``dispatch_model`` with an offload folder): accelerate offloads whole
  modules, and OLMoE's experts are one fused module per layer (``experts.gate_up_proj [E, 2F, D]``), so it
  can only put *all 64 experts of a layer* on disk or in RAM; each forward of an offloaded layer reads the
  whole fused tensor (805 MB) back. Layers kept in RAM: as many as fit in limit − 0.5 GiB after the
  non-expert weights and one layer's transient copy.

Each run is one child process placed in its own cgroup-v1 memory cgroup (``memory.limit_in_bytes`` counts
the page cache: llama.cpp's mmap lives under the same budget as our slots) before it execs; the
checkpoint files' page cache is dropped (``posix_fadvise(DONTNEED)``) before each run. A run prefills a fixed
random prompt, decodes one warm-up token (not timed), then times ``--tokens`` teacher-forced tokens (the same
ids for every system) and reports tok/s and bytes read per token (``/proc/self/io`` ``read_bytes`` over the
timed tokens: every thread's block-device reads, O_DIRECT and page faults alike). Budgets are fractions of
the checkpoint's size (``0.5``) or of the Q4_K_M GGUF's (``q0.5``); within a budget and round the systems are
interleaved, their order rotated and reversed from round to round. Rows go to JSONL;
``--summary`` prints medians per (budget, system).

**Both ISAs on one machine, llama.cpp's best path, time to the first token.** ``--isa avx2`` caps torch's three
kernel libraries in every expertcache child (:data:`ISA_ENV`: ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2``) and requires ``--llama-path`` to name a
llama-cpp-python build without AVX-512 (checked before the work from ``llama_print_system_info()``, the
features it was compiled with; the string is in every llama row). ``--llama-path DIR`` is put first on the
llama children's ``sys.path`` (default: the installed llama-cpp-python). ``--llama-paths repack no-repack``
runs llama.cpp both with its CPU extra buffer types (``repack``, its default) and without (``no-repack``) in
the same rounds; the summary's ``llama-q4-best`` is the (path, readahead) with the higher median, and the
same-round ratios are taken against that path's run in each round. Every row records the CPU model, its ISA
flags (:data:`ROW_CPU_FLAGS`), the ISA label, torch's ATen capability (expertcache children), threads and
``ttft_s``: process start (the orchestrator's spawn) → the first generated token's logits (end of the prefill).
Before the rounds each quantised expertcache configuration runs once (``kind: peers-prime``, in the largest
budget's cgroup) so that its expert sidecar and packed dense cache exist: the timed rows are **second starts**
(their ``sidecar_written`` is False and ``dense_load`` says ``read``), the prime row's ``ttft_s`` a first start
where nothing was built before.

Needs root (cgroups, read_ahead_kb) and the ``peers`` extra (llama-cpp-python, gguf, accelerate)::

    expertcache bench --make-model olmoe-1b-7b --layers 16
    python benchmarks/bench_peers.py convert  --model M --gguf M-bf16.gguf    # llama.cpp's converter
    python benchmarks/bench_peers.py quantize --gguf M-bf16.gguf --gguf-q4 M-Q4_K_M.gguf   # llama.cpp's quantiser
    python benchmarks/bench_peers.py prepare-accelerate --model M --accel-dir D --budgets 0.25 0.5 1.0
    python benchmarks/bench_peers.py run --model M --gguf M-bf16.gguf --accel-dir D --out rows.jsonl
    python benchmarks/bench_peers.py run --model M --gguf-q4 M-Q4_K_M.gguf --systems llama-q4 ec-q4p-cp \
        --llama-paths repack no-repack --isa avx2 --llama-path AVX2_BUILD --out rows.jsonl   # both ISAs: run twice
    python benchmarks/bench_peers.py summary rows.jsonl
    python benchmarks/bench_peers.py compute --model M4 --gguf M4-bf16.gguf    # all-resident, no cgroup, warm
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from expertcache.results import append_jsonl  # rows whole or absent, to row files only

GiB = 2**30
#: llama.cpp file types ``quantize --ftype`` makes (``LLAMA_FTYPE_MOSTLY_<name>``)
QUANT_FTYPES = ("Q4_K_M", "Q4_K_S", "Q4_0", "Q5_K_M", "Q6_K", "Q8_0")
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
SYSTEMS = ("ec-lru", "ec-lru-pf", "ec-cp", "llama", "accelerate", "ec-bench", "llama-q4", "ec-q4-lru", "ec-q4-cp",
           "ec-q4d-lru", "ec-q4d-cp", "ec-q4p-lru", "ec-q4p-cp", "ec-q4m-cp")
#: expertcache children: (routing policy set, --quant, --quant-dense); "q4" = int4 experts, "q4d" = int4 experts
#: and int4 dense weights (the ``quant`` branch's --quant-dense); "q4p" = the ``--quant q4`` preset, "q4m" = ``--quant q4m``
EC_CHILDREN = {"ec-lru": ("original+lru", None, None), "ec-lru-pf": ("original+lru", None, None),
               "ec-cp": ("cache-prior", None, None), "ec-q4-lru": ("original+lru", "int4", None),
               "ec-q4-cp": ("cache-prior", "int4", None), "ec-q4d-lru": ("original+lru", "int4", "int4"),
               "ec-q4d-cp": ("cache-prior", "int4", "int4"), "ec-q4p-lru": ("original+lru", "q4", None),
               "ec-q4p-cp": ("cache-prior", "q4", None), "ec-q4m-cp": ("cache-prior", "q4m", None)}
LLAMA_SYSTEMS = ("llama", "llama-q4")
RESULT_TAG = "PEERS_RESULT "
#: the environment of an expertcache child per ``--isa``: ``avx2`` caps all three of torch's kernel libraries
#: (``ATEN_CPU_CAPABILITY`` alone leaves oneDNN and FBGEMM on AVX-512; BENCHMARKS.md "Which 4-bit kernel on
#: which CPU"); ``native`` removes any cap inherited from the caller
ISA_ENV = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                  "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
                                  # numba (the q4x8 int4 expert kernel, offload/q4x8.py) compiled for AVX2 only
                                  "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2,+fma"}}
#: the CPU flags every row records (``/proc/cpuinfo``): what decides which kernels run
ROW_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
                 "amx_int8", "amx_bf16")
#: llama.cpp's CPU paths: ``repack`` (its default CPU extra buffer types) and ``no-repack`` (``--no-repack``)
LLAMA_PATHS = ("repack", "no-repack")
_T0 = time.time()  # this process's start, near enough (before the heavy imports): a child's sidecar age


# -- small helpers (tested in tests/test_bench_peers.py without llama.cpp, cgroups or root) -----------------

@contextlib.contextmanager
def readahead(kb: int | None, path: str | os.PathLike = "/sys/block/vda/queue/read_ahead_kb"):
    """Set the block device's read-ahead to ``kb`` KiB for the block; the previous value is restored on exit,
    also when the block raises. ``kb=None`` leaves it alone (yields the current value)."""
    path = Path(path)
    old = int(path.read_text().strip())
    if kb is None:
        yield old
        return
    try:
        path.write_text(f"{int(kb)}\n")
        yield int(kb)
    finally:
        path.write_text(f"{old}\n")


def isa_env(isa: str, env: dict) -> dict:
    """``env`` for an expertcache child under ``--isa``: a copy with :data:`ISA_ENV` [isa] set and the other
    caps removed (``native``: none, whatever the caller had set)."""
    if isa not in ISA_ENV:
        raise ValueError(f"--isa {isa!r}: one of {', '.join(ISA_ENV)}")
    out = {k: v for k, v in env.items() if k not in ISA_ENV["avx2"]}
    out.update(ISA_ENV[isa])
    return out


def parse_cpuinfo(text: str) -> dict:
    """The CPU model and which of :data:`ROW_CPU_FLAGS` it has, from ``/proc/cpuinfo``'s text (first CPU)."""
    model, flags = "?", set()
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and model == "?":
            model = val.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(val.split())
    return dict(cpu=model, cpu_flags=[f for f in ROW_CPU_FLAGS if f in flags])


def cpu_row() -> dict:
    """:func:`parse_cpuinfo` of this machine (``cpu='?'`` where ``/proc/cpuinfo`` cannot be read)."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return dict(cpu="?", cpu_flags=[])


def llama_features(info: str) -> dict[str, int]:
    """``NAME = value`` pairs of ``llama_print_system_info()`` (e.g. ``CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 |
    REPACK = 1 |``): the features the build was compiled with, upper-cased names → ints (non-numbers skipped)."""
    out = {}
    for part in info.replace("\n", "|").split("|"):
        name, eq, val = part.rpartition("=")
        name = name.rsplit(":", 1)[-1].strip().upper()
        if eq and name and val.strip().lstrip("-").isdigit():
            out[name] = int(val.strip())
    return out


def llama_build_isa(info: str) -> str:
    """The widest x86 vector ISA a llama.cpp build was compiled for: ``avx512`` (any ``AVX512*`` feature on),
    ``avx2``, or ``none``."""
    feats = llama_features(info)
    if any(k.startswith("AVX512") and v for k, v in feats.items()):
        return "avx512"
    return "avx2" if feats.get("AVX2") else "none"


def check_llama_build(isa: str, info: str, where: str) -> str | None:
    """Why the llama.cpp build at ``where`` (its system info ``info``) cannot stand for ``--isa isa``, or None:
    ``avx2`` needs a build with AVX2 and without any AVX-512 feature (an AVX-512 build would be measured as
    the AVX2 one)."""
    built = llama_build_isa(info)
    if isa == "avx2" and built != "avx2":
        return (f"--llama-path {where}: --isa avx2 needs a llama.cpp built for AVX2 without AVX-512, this one is "
                f"{built} ({info.strip()[:160]})")
    return None


def proc_io(pid: str | int = "self") -> dict[str, int]:
    """``/proc/<pid>/io`` as ints (read_bytes = bytes this process caused to be read from the block device)."""
    out = {}
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k.strip()] = int(v)
    return out


def checkpoint_bytes(model: str | os.PathLike) -> int:
    """Bytes of the checkpoint's weight files (``*.safetensors``)."""
    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model}: no *.safetensors files")
    return sum(f.stat().st_size for f in files)


def budget_limit(spec: str | float, checkpoint: int, q4: int | None = None) -> tuple[float, int, str]:
    """A ``--budgets`` entry → (fraction of the checkpoint, cgroup limit in bytes, label). ``0.5`` is half the
    bf16 checkpoint; ``q0.25`` a quarter of the Q4_K_M GGUF's size (``q4``: its bytes; needed then). The
    fraction is what rows record as ``budget`` (one axis for both kinds), the label what tables show."""
    text = str(spec).strip().lower()
    of_q4 = text.startswith("q")
    try:
        frac = float(text[1:] if of_q4 else text)
    except ValueError:
        raise ValueError(f"budget {spec!r}: give a fraction of the checkpoint (0.5) or of the Q4 GGUF (q0.5)") from None
    if not 0 < frac <= 4:
        raise ValueError(f"budget {spec!r}: the fraction must be in (0, 4]")
    if of_q4:
        if not q4:
            raise ValueError(f"budget {spec!r} is a fraction of the Q4_K_M GGUF: give --gguf-q4")
        limit = int(frac * q4)
        return limit / checkpoint, limit, f"{frac:g} of Q4_K_M ({limit / 1e9:.2f} GB)"
    limit = int(frac * checkpoint)
    return frac, limit, f"{frac:g} of bf16 ({limit / 1e9:.2f} GB)"


def accelerate_split(limit: int, nonexpert: int, layer_experts: int, layers: int, reserve: int = GiB // 2) -> int:
    """How many layers' fused experts accelerate may keep in RAM under a cgroup of ``limit`` bytes: what fits
    in limit − ``reserve`` after the non-expert weights and one offloaded layer's transient copy (accelerate
    loads an offloaded module's whole weights for each forward). Between 0 and ``layers``."""
    room = limit - reserve - nonexpert - layer_experts
    return max(0, min(layers, room // layer_experts))


def drop_page_cache(paths) -> int:
    """``posix_fadvise(DONTNEED)`` on every file under ``paths`` (files or folders); returns the bytes covered.
    Clean, unmapped pages leave the page cache (so the next run's reads are charged to its own cgroup)."""
    total = 0
    for p in paths:
        if p is None:
            continue
        p = Path(p)
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else []
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += f.stat().st_size
            finally:
                os.close(fd)
    return total


def summarize(rows: list[dict]) -> list[dict]:
    """Medians per (budget, system, readahead, llama.cpp path) of the successful timed rows (``kind`` ``peers``;
    prime runs are left out); failed runs are counted, not averaged. Each budget also gets a ``llama-best``
    entry: the llama.cpp readahead with the higher median tok/s; and ``llama-q4-best``: the llama.cpp Q4_K_M
    (path, readahead) with the higher median tok/s, where more than one ran."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("kind", "peers") == "peers":
            groups.setdefault((r["budget"], r["system"], r.get("readahead_kb"), r.get("llama_path")), []).append(r)
    out = []
    for (budget, system, ra, path), rs in sorted(groups.items(),
                                                 key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0, kv[0][3] or "")):
        ok = [r for r in rs if r.get("ok")]
        s = dict(budget=budget, system=system, readahead_kb=ra, llama_path=path, runs=len(rs), failed=len(rs) - len(ok),
                 errors=sorted({r.get("error", "") for r in rs if not r.get("ok")}))
        if ok:
            s["tok_s"] = statistics.median(r["tok_s"] for r in ok)
            s["tok_s_runs"] = [round(r["tok_s"], 3) for r in ok]
            s["bytes_per_token"] = statistics.median(r["bytes_per_token"] for r in ok)
            ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
            if ttft:
                s["ttft_s"] = statistics.median(ttft)
                s["ttft_runs"] = [round(x, 1) for x in ttft]
            for k in ("max_usage_bytes", "capacity", "resident_layers"):
                vals = [r[k] for r in ok if r.get(k) is not None]
                if vals:
                    s[k] = max(vals) if k == "max_usage_bytes" else vals[0]
        out.append(s)
    for budget in sorted({s["budget"] for s in out}):
        llamas = [s for s in out if s["budget"] == budget and s["system"] == "llama" and "tok_s" in s]
        if llamas:
            best = max(llamas, key=lambda s: s["tok_s"])
            out.append(dict(best, system="llama-best"))
        q4_ran = [s for s in out if s["budget"] == budget and s["system"] == "llama-q4"]
        q4 = [s for s in q4_ran if "tok_s" in s]
        if q4 and len(q4_ran) > 1:  # several readaheads or paths (a path that failed in every run counts as
            # slower): the better one is the reference
            out.append(dict(max(q4, key=lambda s: s["tok_s"]), system="llama-q4-best"))
    return out


EC_SYSTEMS = tuple(EC_CHILDREN)


def ratios(summary: list[dict], ref: str = "llama-best") -> dict:
    """Per budget: median tok/s of each expertcache system ÷ the reference's (``llama-best``: llama.cpp on
    bf16 at its better readahead; ``llama-q4``: llama.cpp on the Q4_K_M GGUF)."""
    res = {}
    for s in summary:
        if s["system"] != ref or "tok_s" not in s:
            continue
        for e in summary:
            if e["budget"] == s["budget"] and e["system"] in EC_SYSTEMS and "tok_s" in e:
                res[(s["budget"], e["system"])] = e["tok_s"] / s["tok_s"]
    return res


def round_ratios(rows: list[dict], ref: str = "llama", best: dict | None = None, key: str = "tok_s") -> dict:
    """Per budget and expertcache system: the ratios within each round (the system's ``key`` ÷ the faster of
    that round's ``ref`` runs: ``llama`` bf16, ``llama-q4``), one per round where both ran -- the same-run
    ratios. ``best``: budget → (readahead_kb, llama_path) of the reference's best configuration (the
    summary's ``llama-q4-best``): only that configuration's run of each round is the reference. ``key``:
    ``tok_s``, or ``ttft_s`` (then the reference is the round's smaller time)."""
    res: dict[tuple, list[float]] = {}
    ok = [r for r in rows if r.get("ok") and r.get("kind", "peers") == "peers" and r.get(key) is not None]
    pick = min if key == "ttft_s" else max
    for b, rnd in sorted({(r["budget"], r["round"]) for r in ok}):
        same = [r for r in ok if r["budget"] == b and r["round"] == rnd]
        llama = [r[key] for r in same if r["system"] == ref
                 and (best is None or b not in best or (r.get("readahead_kb"), r.get("llama_path")) == best[b])]
        if not llama:
            continue
        for r in same:
            if r["system"] in EC_SYSTEMS:
                res.setdefault((b, r["system"]), []).append(r[key] / pick(llama))
    return res


# -- cgroup-v1 memory cgroup ------------------------------------------------------------------------------

class MemoryCgroup:
    """A cgroup-v1 memory cgroup with a hard limit (page cache included); removed on ``close``."""

    def __init__(self, name: str, limit: int, root: Path = CGROUP_ROOT):
        self.path = root / name
        if self.path.exists():
            self._rmdir()
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(int(limit)))
        self.limit = int((self.path / "memory.limit_in_bytes").read_text())

    def join(self) -> None:
        """Move the calling process into the cgroup (used as the child's ``preexec_fn``)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def stats(self) -> dict:
        def read(name):
            try:
                return (self.path / name).read_text()
            except OSError:
                return ""
        st = {}
        for line in read("memory.stat").splitlines():
            k, _, v = line.partition(" ")
            if k in ("cache", "rss", "mapped_file", "pgmajfault", "total_pgmajfault"):
                st[k] = int(v)
        oom = {}
        for line in read("memory.oom_control").splitlines():
            k, _, v = line.partition(" ")
            oom[k] = int(v) if v.strip().isdigit() else v
        return dict(max_usage_bytes=int(read("memory.max_usage_in_bytes") or 0), failcnt=int(read("memory.failcnt") or 0),
                    oom_kill=oom.get("oom_kill"), stat=st)

    def _rmdir(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                try:
                    (self.path / "memory.force_empty").write_text("0")
                except OSError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"could not remove cgroup {self.path}")

    def close(self) -> None:
        if self.path.exists():
            self._rmdir()


# -- the children (one system, one run, inside the cgroup) ------------------------------------------------

def _ids(vocab: int, n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _result(**kw) -> None:
    print(RESULT_TAG + json.dumps(kw), flush=True)


def child_expertcache(a) -> None:
    import dataclasses

    import torch

    torch.set_num_threads(a.threads)
    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.offload.bench import policy_set

    cfg = json.loads((Path(a.model) / "config.json").read_text())
    k, vocab = cfg["num_experts_per_tok"], cfg["vocab_size"]
    name, quant, quant_dense = EC_CHILDREN[a.system]
    routing, eviction = policy_set(k)[name]
    # inside its cgroup: --memory auto (the plan reads the limit and counts the whole process), or the old
    # advice of limit − 0.5 GiB (--ec-memory reserve)
    memory = "auto" if a.ec_memory == "auto" else a.limit - GiB // 2
    extra = dict(quant=quant) if quant else {}
    if quant_dense:
        if "quant_dense" not in {f.name for f in dataclasses.fields(OffloadConfig)}:
            raise SystemExit(f"{a.system}: this expertcache has no --quant-dense (the quant branch adds it)")
        extra["quant_dense"] = quant_dense
    ctx = a.prompt_tokens + a.tokens + 2
    prefetch = a.prefetch
    rt = None
    if a.resident:  # all-resident compute (C = N, every expert loaded before the prompt; no reads while decoding)
        rt = OffloadedModel.from_pretrained(a.model, OffloadConfig(capacity=cfg["num_experts"], context=ctx,
                                                                   readers=a.readers, **extra), routing=routing,
                                            eviction=eviction)
        rt.warm()
        prefetch = 0
    if prefetch and rt is None:
        from expertcache.offload.budget import BudgetError

        try:
            rt = OffloadedModel.from_pretrained(a.model, OffloadConfig(memory=memory, context=ctx, readers=a.readers,
                                                                       prefetch=prefetch, **extra), routing=routing,
                                                eviction=eviction)
        except BudgetError:  # the spares do not fit next to C = K: prefetch off at this budget
            pass
        if rt is None:
            prefetch = 0
    if rt is None:
        rt = OffloadedModel.from_pretrained(a.model, OffloadConfig(memory=memory, context=ctx, readers=a.readers,
                                                                   **extra), routing=routing, eviction=eviction)
    prompt = torch.tensor([_ids(vocab, a.prompt_tokens, 0)])
    forced = _ids(vocab, a.tokens + 1, 1)
    with torch.inference_mode():
        logits, past = rt.prefill(prompt)
        first_token_at = time.time()  # the first generated token's logits
        logits, past = rt.decode_one_token(torch.tensor([[forced[0]]]), past)  # warm-up token
        s0, io0 = rt.stats(), proc_io()
        times = []
        for t in forced[1:]:
            t0 = time.perf_counter()
            logits, past = rt.decode_one_token(torch.tensor([[t]]), past)
            times.append(time.perf_counter() - t0)
        assert bool(torch.isfinite(logits).all())
        s1, io1 = rt.stats(), proc_io()
    n = len(times)
    d = rt.describe()
    side = getattr(rt.source, "path", None)  # the quantised experts' sidecar (None: bf16 experts)
    from expertcache.offload.kernelnote import kernel_choice_line

    start = dict(first_token_at=first_token_at, aten_capability=d["cpu"].get("aten_capability"),
                 isa_env=d["cpu"].get("isa_env"), quant_kernel=d.get("quant_kernel"), dense_kernel=d.get("dense_kernel"),
                 dense_load=d.get("dense_load"), quant_opt=d.get("quant_opt"),
                 kernel_line=kernel_choice_line(rt.offload.quant, rt.offload.quant_dense, norms=rt.host_norms) if rt.offload.quant or
                 rt.offload.quant_dense else None,
                 sidecar=Path(side).name if side else None,
                 sidecar_written=bool(side) and Path(side).stat().st_mtime > _T0)  # False: read (a second start)
    _result(ok=True, tok_s=n / sum(times), times=times, bytes_per_token=(io1["read_bytes"] - io0["read_bytes"]) / n,
            **start, runtime_bytes_per_token=(s1["bytes_read"] - s0["bytes_read"]) / n,
            hit_rate=(s1["hits"] - s0["hits"]) / max(1, s1["accesses"] - s0["accesses"]),
            capacity=rt.capacity, prefetch=prefetch, readers=a.readers, memory=rt.plan.budget, plan_bytes=rt.plan.total,
            process_peak=rt.plan.process_peak, policy=name, quant=quant, quant_dense=quant_dense, ec_memory=a.ec_memory,
            resolved_quant=rt.offload.quant, resolved_quant_dense=rt.offload.quant_dense)


def import_llama(path: str | None):
    """llama_cpp from ``path`` (put first on ``sys.path``: a build that is not installed), else the installed one."""
    if path:
        sys.path.insert(0, str(Path(path).resolve()))
    import llama_cpp

    return llama_cpp


def child_llama(a) -> None:
    llama_cpp = import_llama(a.llama_path)
    meta = json.loads((Path(a.model) / "config.json").read_text())
    vocab = meta["vocab_size"]
    gguf = a.gguf_q4 if a.system == "llama-q4" else a.gguf
    if a.no_repack:
        no_repack(llama_cpp)
    llm = llama_cpp.Llama(gguf, n_ctx=max(64, a.prompt_tokens + a.tokens + 8), n_threads=a.threads,
                          n_threads_batch=a.threads, n_batch=max(8, a.prompt_tokens), use_mmap=True, use_mlock=False,
                          verbose=False)
    prompt = _ids(vocab, a.prompt_tokens, 0)
    forced = _ids(vocab, a.tokens + 1, 1)
    llm.eval(prompt)
    first_token_at = time.time()  # the first generated token's logits
    llm.eval([forced[0]])  # warm-up token
    io0 = proc_io()
    times = []
    for t in forced[1:]:
        t0 = time.perf_counter()
        llm.eval([t])
        times.append(time.perf_counter() - t0)
    io1 = proc_io()
    n = len(times)
    _result(ok=True, tok_s=n / sum(times), times=times, bytes_per_token=(io1["read_bytes"] - io0["read_bytes"]) / n,
            llama_cpp=llama_cpp.__version__, gguf=Path(gguf).name, gguf_bytes=Path(gguf).stat().st_size,
            no_repack=bool(a.no_repack), first_token_at=first_token_at,
            llama_system_info=llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            llama_build=llama_build_isa(llama_cpp.llama_print_system_info().decode(errors="replace")))


def no_repack(llama_cpp) -> None:
    """llama.cpp's ``--no-repack`` for llama-cpp-python, which has no argument for it: every model it loads
    gets ``use_extra_bufts = False`` (no CPU "extra" buffer types: no runtime repacking of Q4_K into
    interleaved blocks, no AMX buffers), set in the default model params its ``Llama`` starts from."""
    import llama_cpp.llama as llama_py

    low = llama_py.llama_cpp
    default = low.llama_model_default_params
    if getattr(default, "_no_repack", False):
        return

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    params._no_repack = True
    low.llama_model_default_params = params


def _fused_experts(f, layer: int, experts: int):
    """transformers' fused OLMoE expert tensors of one layer from the per-expert checkpoint keys."""
    import torch

    p = f"model.layers.{layer}.mlp.experts"
    gate_up = torch.stack([torch.cat([f.get_tensor(f"{p}.{e}.gate_proj.weight"), f.get_tensor(f"{p}.{e}.up_proj.weight")])
                           for e in range(experts)])
    down = torch.stack([f.get_tensor(f"{p}.{e}.down_proj.weight") for e in range(experts)])
    return gate_up, down


def split_device_map(model, disk: set[str]) -> dict[str, str]:
    """accelerate device map: the ``disk`` modules on 'disk', every other module on 'cpu', modules that contain
    a disk module split into their children (what ``infer_auto_device_map`` produces; a '' → cpu entry would
    make accelerate place the disk modules' meta weights on the CPU)."""
    dm = {}

    def visit(mod, name):
        if name in disk:
            dm[name] = "disk"
        elif any(d.startswith(name + ".") for d in disk) or (name == "" and disk):
            if any(True for _ in mod.named_parameters(recurse=False)):
                raise ValueError(f"{name or 'the model'} has its own weights and contains offloaded modules")
            for cn, c in mod.named_children():
                visit(c, f"{name}.{cn}" if name else cn)
        else:
            dm[name] = "cpu"

    visit(model, "")
    return dm


def _olmoe_sizes(model) -> tuple[int, int, int, int]:
    """(non-expert bytes, bytes of one layer's experts, layers, experts) of a bf16 OLMoE checkpoint."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    L, E, D, F = cfg["num_hidden_layers"], cfg["num_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    layer = E * 3 * D * F * 2
    return checkpoint_bytes(model) - L * layer, layer, L, E


def prepare_accelerate(a) -> None:
    """Write accelerate's offload folder (index.json + one .dat per fused expert tensor) for every layer that
    is offloaded at the smallest budget (the larger budgets offload a suffix of those)."""
    from accelerate.utils import offload_weight, save_offload_index
    from safetensors import safe_open

    nonexpert, layer_b, L, E = _olmoe_sizes(a.model)
    size = checkpoint_bytes(a.model)
    resident = min(accelerate_split(budget_limit(b, size)[1], nonexpert, layer_b, L) for b in a.budgets)
    out = Path(a.accel_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    with safe_open(str(Path(a.model) / "model.safetensors"), "pt") as f:
        for layer in range(resident, L):
            gate_up, down = _fused_experts(f, layer, E)
            for nm, t in (("gate_up_proj", gate_up), ("down_proj", down)):
                index = offload_weight(t, f"model.layers.{layer}.mlp.experts.{nm}", str(out), index=index)
            del gate_up, down
            print(f"layer {layer} offloaded", flush=True)
    save_offload_index(index, str(out))


def child_accelerate(a) -> None:
    import torch

    torch.set_num_threads(1)
    from accelerate import dispatch_model, init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    nonexpert, layer_b, L, E = _olmoe_sizes(a.model)
    resident = accelerate_split(a.limit, nonexpert, layer_b, L)
    config = AutoConfig.from_pretrained(a.model)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    sd = {}
    with safe_open(str(Path(a.model) / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if ".mlp.experts." not in key:
                sd[key] = f.get_tensor(key)
        for layer in range(resident):
            gu, dn = _fused_experts(f, layer, E)
            sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"], sd[f"model.layers.{layer}.mlp.experts.down_proj"] = gu, dn
    missing = model.load_state_dict(sd, strict=False, assign=True).missing_keys
    del sd
    expected = {f"model.layers.{i}.mlp.experts.{n}" for i in range(resident, L) for n in ("gate_up_proj", "down_proj")}
    if set(missing) != expected:
        raise RuntimeError(f"unexpected missing weights: {sorted(set(missing) ^ expected)[:6]}")
    device_map = split_device_map(model, {f"model.layers.{i}.mlp.experts" for i in range(resident, L)})
    model = dispatch_model(model, device_map=device_map, offload_dir=a.accel_dir)
    model.eval()
    from transformers import DynamicCache

    vocab = config.vocab_size
    prompt = torch.tensor([_ids(vocab, a.prompt_tokens, 0)])
    forced = _ids(vocab, a.tokens + 1, 1)
    with torch.inference_mode():
        past = DynamicCache(config=config)
        out = model(prompt, past_key_values=past, use_cache=True)  # the warm-up (a whole pass over the disk layers)
        io0 = proc_io()
        times = []
        for t in forced[1:]:
            t0 = time.perf_counter()
            out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
            times.append(time.perf_counter() - t0)
        io1 = proc_io()
    n = len(times)
    _result(ok=True, tok_s=n / sum(times), times=times, bytes_per_token=(io1["read_bytes"] - io0["read_bytes"]) / n,
            resident_layers=resident, offloaded_layers=L - resident)


def child(a) -> None:
    if a.system in EC_CHILDREN:
        from expertcache.offload.budget import BudgetError

        try:
            return child_expertcache(a)
        except BudgetError as exc:  # the plan's refusal, before loading: one line, exit 2 (as the CLI does)
            print(f"refused: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
    {"llama": child_llama, "llama-q4": child_llama, "accelerate": child_accelerate}[a.system](a)


# -- the orchestrator -------------------------------------------------------------------------------------

def run_one(a, system: str, budget: float, limit: int, rnd: int, ra_kb: int | None, label: str = "",
            path: str | None = None, kind: str = "peers", timeout: int | None = None) -> dict:
    """One child run inside a fresh cgroup; returns its row (ok=False with the reason on failure). ``path``:
    llama.cpp's CPU path (:data:`LLAMA_PATHS`) for a llama child; ``kind``: ``peers`` (timed) or ``peers-prime``
    (the run that builds a quantised configuration's sidecar and dense cache, before the rounds)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    if system not in LLAMA_SYSTEMS:  # torch's kernel libraries capped per --isa (llama.cpp: its build)
        env = isa_env(a.isa, env)
    timeout = timeout or a.timeout
    here = Path(__file__).resolve()
    if system == "ec-bench":  # the CLI benchmark itself inside the cgroup (target: it completes)
        cmd = [sys.executable, "-m", "expertcache.cli.main", "bench", "--model", a.model, "--memory",
               "auto" if a.ec_memory == "auto" else str(limit - GiB // 2), "--policies", "original+lru", "cache-prior", "--tokens", str(a.tokens),
               "--prompt-tokens", str(a.prompt_tokens), "--repeats", "1", "--threads", "1", "--json"]
    else:
        cmd = [sys.executable, str(here), "child", "--system", system, "--model", a.model, "--limit", str(limit),
               "--tokens", str(a.accel_tokens if system == "accelerate" else a.tokens), "--prompt-tokens", str(a.prompt_tokens), "--readers", str(a.readers),
               "--prefetch", str(a.prefetch if system == "ec-lru-pf" else 0), "--ec-memory", a.ec_memory,
               "--threads", str(a.threads), "--isa", a.isa]
        if system in LLAMA_SYSTEMS:
            cmd += ["--gguf", str(a.gguf), "--gguf-q4", str(a.gguf_q4)] + (["--no-repack"] if path == "no-repack" else [])
            if a.llama_path:
                cmd += ["--llama-path", str(a.llama_path)]
        if system == "accelerate":
            cmd += ["--accel-dir", a.accel_dir]
    drop_page_cache([a.model, a.gguf, a.gguf_q4, a.accel_dir])
    cg = MemoryCgroup(f"peers-{os.getpid()}-{system}", limit)
    row = dict(kind=kind, model=Path(a.model).name, system=system, budget=budget, budget_label=label,
               limit_bytes=limit, round=rnd, readahead_kb=ra_kb, isa=a.isa, threads=a.threads, **cpu_row(),
               llama_path=path if system in LLAMA_SYSTEMS else None,
               start=("second (sidecar and dense cache built by the prime run)" if kind == "peers"
                      and EC_CHILDREN.get(system, (None, None))[1] else
                      "first (prime run)" if kind == "peers-prime" else "fresh process, page cache dropped"),
               tokens=a.accel_tokens if system == "accelerate" else a.tokens, prompt_tokens=a.prompt_tokens, date=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
               loadavg=os.getloadavg()[0])
    t0 = time.perf_counter()
    try:
        with readahead(ra_kb, f"/sys/block/{a.device}/queue/read_ahead_kb") as ra:
            row["readahead_kb"] = ra
            spawn = time.time()
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                 preexec_fn=cg.join)
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                row.update(ok=False, error=f"timeout after {timeout} s")
            except BaseException:
                p.kill()
                p.wait()
                raise
        row.update(cg.stats(), wall_s=time.perf_counter() - t0, returncode=p.returncode)
    finally:
        cg.close()
    if "error" in row:
        return row
    if system == "ec-bench":
        if p.returncode == 0:
            res = json.loads(out.strip().splitlines()[-1])
            row.update(ok=True, tok_s=min(s["tok_s"] for s in res["summary"]), bench=res["summary"],
                       bytes_per_token=max(s["bytes_per_token"] for s in res["summary"]))
        else:
            row.update(ok=False, error=f"exit {p.returncode}: {(err.strip().splitlines() or [''])[-1][:300]}")
        return row
    lines = [l for l in out.splitlines() if l.startswith(RESULT_TAG)]
    if p.returncode == 0 and lines:
        row.update(json.loads(lines[-1][len(RESULT_TAG):]))
        if row.get("first_token_at") is not None:
            row["ttft_s"] = row["first_token_at"] - spawn
        kernels = [l.strip() for l in err.splitlines() if "kernels on" in l]
        if kernels:
            row["kernel_stderr"] = kernels[-1]
    else:
        why = "killed by SIGKILL (cgroup OOM)" if p.returncode == -9 and row.get("oom_kill") else f"exit {p.returncode}"
        row.update(ok=False, error=f"{why}: {(err.strip().splitlines() or [''])[-1][:300]}")
    return row


def run_plan(systems, llama_paths, low_readahead: int, low_readahead_only: bool) -> list[tuple]:
    """The runs of one round, ``(system, read_ahead_kb or None for the device's default, llama.cpp path or
    None)``: each llama.cpp system once per path and readahead, every other system once."""
    plan = []
    for s in systems:
        if s in LLAMA_SYSTEMS:
            for path in llama_paths:
                plan += ([] if low_readahead_only else [(s, None, path)]) + [(s, low_readahead, path)]
        else:
            plan.append((s, None, None))
    return plan


def prime_systems(systems) -> list[str]:
    """One expertcache system per quantised configuration (--quant, --quant-dense) among ``systems``: running
    it once builds the sidecar and the packed dense cache the others then read."""
    seen, out = set(), []
    for s in systems:
        _, quant, dense = EC_CHILDREN.get(s, (None, None, None))
        if (quant or dense) and (quant, dense) not in seen:
            seen.add((quant, dense))
            out.append(s)
    return out


def round_order(plan: list, rnd: int) -> list:
    """The systems' order in round ``rnd``: reversed on odd rounds (so every system runs both before and after
    each other one within two rounds: A B, B A) and rotated by one every two rounds."""
    k = (rnd // 2) % len(plan) if plan else 0
    order = plan[k:] + plan[:k]
    return order[::-1] if rnd % 2 else order


def orchestrate(a) -> None:
    size = checkpoint_bytes(a.model)
    ra_path = f"/sys/block/{a.device}/queue/read_ahead_kb"
    default_ra = int(Path(ra_path).read_text())
    plan = run_plan(a.systems, a.llama_paths, a.low_readahead, a.low_readahead_only)
    q4 = Path(a.gguf_q4).stat().st_size if a.gguf_q4 else a.q4_bytes
    budgets = [budget_limit(b, size, q4) for b in a.budgets]
    print(f"checkpoint {size / 1e9:.2f} GB; read_ahead_kb default {default_ra}; load {os.getloadavg()[0]:.1f}; "
          f"--isa {a.isa}, {a.threads} thread(s); {cpu_row()}", flush=True)
    import signal

    def stop(signum, frame):  # SIGTERM: unwind (kill the child, remove its cgroup, restore read_ahead_kb)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    def report(row, label, limit):
        if a.out:
            append_jsonl(a.out, row)
        msg = (f"{row['tok_s']:.3f} tok/s, {row['bytes_per_token'] / 2**20:.0f} MiB/token, "
               f"TTFT {row.get('ttft_s') or float('nan'):.1f} s" if row.get("ok") else row.get("error"))
        path = f" {row['llama_path']}" if row.get("llama_path") else ""
        print(f"[{label} r{row['round']}] {row['system']}{path:<10} ra={row['readahead_kb']:<5} {msg}  "
              f"(max {row.get('max_usage_bytes', 0) / 2**30:.2f} GiB of {limit / 2**30:.2f}, "
              f"{row['wall_s']:.0f} s, load {row['loadavg']:.1f})", flush=True)

    try:
        if not a.no_prime:  # each quantised configuration once: its sidecar and dense cache built, the rows second starts
            budget, limit, label = max(budgets, key=lambda b: b[1])
            for system in prime_systems([s for s, _, _ in plan]):
                report(run_one(a, system, budget, limit, -1, None, label, kind="peers-prime",
                               timeout=a.prime_timeout), label, limit)
        for budget, limit, label in budgets:
            for rnd in range(a.first_round, a.first_round + a.rounds):
                order = round_order(plan, rnd)
                for system, ra, path in order:
                    if system == "ec-bench" and rnd > a.first_round:
                        continue
                    report(run_one(a, system, budget, limit, rnd, ra, label, path), label, limit)
    finally:
        Path(ra_path).write_text(f"{default_ra}\n")


def compute(a) -> None:
    """All-resident compute, no cgroup, page cache warm: expertcache at C = N (every expert loaded, original
    routing) against llama.cpp (mmap, the GGUF read once beforehand), interleaved, ``--rounds`` each."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    here = str(Path(__file__).resolve())
    with open(a.gguf, "rb") as f:  # page cache warm for llama.cpp
        while f.read(64 << 20):
            pass
    for rnd in range(a.rounds):
        for system in (("ec-lru", "llama") if rnd % 2 == 0 else ("llama", "ec-lru")):
            cmd = [sys.executable, here, "child", "--system", system, "--model", a.model, "--limit", "0", "--tokens",
                   str(a.tokens), "--prompt-tokens", str(a.prompt_tokens), "--prefetch", "0", "--resident"]
            if system == "llama":
                cmd += ["--gguf", a.gguf]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [l for l in p.stdout.splitlines() if l.startswith(RESULT_TAG)]
            row = dict(kind="peers-compute", system="ec-resident" if system == "ec-lru" else "llama-warm", round=rnd,
                       tokens=a.tokens, prompt_tokens=a.prompt_tokens, loadavg=os.getloadavg()[0],
                       date=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
            if p.returncode == 0 and lines:
                row.update(json.loads(lines[-1][len(RESULT_TAG):]))
                row["ms_per_token"] = 1e3 * statistics.median(row["times"])
            else:
                row.update(ok=False, error=(p.stderr.strip().splitlines() or [""])[-1][:300])
            if a.out:
                append_jsonl(a.out, row)
            print(f"[r{rnd}] {row['system']:<12} " + (f"{row['tok_s']:.2f} tok/s, median {row['ms_per_token']:.1f} ms/token, "
                  f"{row['bytes_per_token'] / 2**20:.1f} MiB read/token" if row.get("ok") else row["error"])
                  + f" (load {row['loadavg']:.1f})", flush=True)


def convert(a) -> None:
    """llama.cpp's convert_hf_to_gguf.py (from the llama-cpp-python sdist) to a bf16 GGUF (``--outtype``). The
    random-weight checkpoint's small byte-level tokenizer is unknown to the converter's pre-tokenizer table: it is written
    as 'gpt-2' (the benchmark feeds token ids; the tokenizer is never used)."""
    import runpy

    vendor = str(Path(a.vendor).resolve())
    sys.path.insert(0, vendor)
    import conversion.base as base

    orig = base.TextModel.get_vocab_base_pre

    def pre(self, tokenizer):
        try:
            return orig(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = pre
    sys.argv = [f"{vendor}/convert_hf_to_gguf.py", a.model, "--outtype", a.outtype, "--outfile", a.gguf]
    runpy.run_path(sys.argv[0], run_name="__main__")


def quantize(a) -> None:
    """llama.cpp's own quantiser (``llama_model_quantize`` of the llama.cpp that llama-cpp-python vendors, as
    ``llama-quantize`` runs it): the bf16 GGUF ``--gguf`` → Q4_K_M ``--gguf-q4`` (attention, embedding and
    output included, at llama.cpp's per-tensor choices for that type); ``--ftype`` another of its types."""
    import ctypes

    llama_cpp = import_llama(a.llama_path)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{a.ftype}")
    params.nthread = a.threads
    tmp = f"{a.gguf_q4}.tmp"
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(a.gguf).encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed ({rc})")
    os.replace(tmp, a.gguf_q4)
    print(f"{a.gguf_q4}: {Path(a.gguf_q4).stat().st_size / 1e9:.2f} GB {a.ftype} in {time.perf_counter() - t0:.0f} s "
          f"(llama-cpp-python {llama_cpp.__version__})")


def table_key(row: dict) -> tuple:
    """Which table a row belongs to: (checkpoint, ISA label, threads). Budgets are fractions of each
    checkpoint's own size, and an ISA or thread count is another machine: rows of different keys never share a
    median or a same-round ratio (rows from before these fields: ISA ``native``, 1 thread)."""
    return row.get("model", ""), row.get("isa", "native"), row.get("threads", 1)


def print_summary(a) -> None:
    """One table per (checkpoint, ISA, threads) (:func:`table_key`)."""
    rows = [json.loads(l) for f in a.rows for l in open(f) if l.strip()]
    keys = sorted({table_key(r) for r in rows})
    for key in keys:
        model, isa, threads = key
        if len(keys) > 1:
            print(f"\n### {model or 'checkpoint not recorded'}" + (f" · --isa {isa}" if isa != "native" else "")
                  + (f" · {threads} threads" if threads != 1 else "") + "\n")
        print_table([r for r in rows if table_key(r) == key])


def print_table(rows: list[dict]) -> None:
    labels = {r["budget"]: r.get("budget_label") or f"{r['budget']:.0%} of bf16" for r in rows}
    summ = summarize(rows)
    cpus = sorted({(r.get("cpu"), " ".join(r.get("cpu_flags") or [])) for r in rows if r.get("cpu")})
    for cpu, flags in cpus:
        print(f"CPU: {cpu} [{flags}]")
    loads = [r["loadavg"] for r in rows if r.get("loadavg") is not None and r.get("kind", "peers") == "peers"]
    if loads:
        print(f"load average over the runs: {min(loads):.1f}–{max(loads):.1f} (median {statistics.median(loads):.1f})")
    for r in rows:
        if r.get("kind") == "peers-prime":
            print(f"prime (first start) {r['system']}: " + (f"TTFT {r.get('ttft_s', float('nan')):.1f} s, sidecar "
                  f"{'written' if r.get('sidecar_written') else 'read'}, dense {(r.get('dense_load') or {}).get('how', r.get('dense_load'))}"
                  if r.get("ok") else r.get("error", "")))
    print("| budget | system | llama.cpp path | read_ahead_kb | tok/s (median) | tok/s per run | MiB read/token | "
          "TTFT s (median) | failed |")
    print("|---|---|---|---:|---:|---|---:|---:|---:|")
    for s in summ:
        tok = f"{s['tok_s']:.2f}" if "tok_s" in s else "–"
        mib = f"{s['bytes_per_token'] / 2**20:.0f}" if "bytes_per_token" in s else "–"
        ttft = f"{s['ttft_s']:.1f}" if "ttft_s" in s else "–"
        print(f"| {labels.get(s['budget'], s['budget'])} | {s['system']} | {s.get('llama_path') or ''} | "
              f"{s['readahead_kb'] or ''} | {tok} | {' · '.join(map(str, s.get('tok_s_runs', [])))} | {mib} | {ttft} | "
              f"{s['failed']} {'; '.join(s['errors'])[:120]} |")
    q4_ref = "llama-q4-best" if any(s["system"] == "llama-q4-best" for s in summ) else "llama-q4"
    best = {s["budget"]: (s["readahead_kb"], s.get("llama_path")) for s in summ if s["system"] == "llama-q4-best"}
    for ref, row_ref, what, cfg in (("llama-best", "llama", "llama.cpp bf16 (better readahead)", None),
                                    (q4_ref, "llama-q4", "llama.cpp Q4_K_M's best path", best)):
        per_round = round_ratios(rows, row_ref, cfg)
        ttft_round = round_ratios(rows, row_ref, cfg, key="ttft_s")
        for (b, sys_), r in sorted(ratios(summ, ref).items()):
            rr = per_round.get((b, sys_), [])
            tr = ttft_round.get((b, sys_), [])
            path = f" ({best[b][1]}, ra {best[b][0]})" if cfg and b in best else ""
            print(f"{labels.get(b, b)} {sys_} ÷ {what}{path}: {r:.2f}× of the medians; within each round "
                  f"{' · '.join(f'{x:.2f}' for x in rr)} (median {statistics.median(rr) if rr else float('nan'):.2f})"
                  + (f"; TTFT ratio per round {' · '.join(f'{x:.2f}' for x in tr)}" if tr else ""))


def llama_system_info(path: str | None) -> str:
    """``llama_print_system_info()`` of the llama-cpp-python at ``path`` (None: the installed one), read in a
    child process (importing llama_cpp here would fix which build this process uses). RuntimeError when it does
    not import."""
    code = ("import sys\nif sys.argv[1]: sys.path.insert(0, sys.argv[1])\nimport llama_cpp\n"
            "print(llama_cpp.llama_print_system_info().decode(errors='replace'))")
    p = subprocess.run([sys.executable, "-c", code, str(Path(path).resolve()) if path else ""], capture_output=True,
                       text=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError((p.stderr.strip().splitlines() or ["no output"])[-1][:200])
    return p.stdout


def check_args(a, probe=llama_system_info) -> str | None:
    """Why ``a`` (run / compute / quantize arguments) cannot run, in one line naming the flag, or None; checked
    before any work. ``probe(path)``: the llama.cpp build's system info (RuntimeError if it does not import)."""
    if getattr(a, "threads", 1) < 1:
        return f"--threads must be at least 1, got {a.threads}"
    if getattr(a, "rounds", 1) < 1:
        return f"--rounds must be at least 1, got {a.rounds}"
    if a.llama_path and not Path(a.llama_path, "llama_cpp").is_dir():
        return f"--llama-path {a.llama_path}: no llama_cpp package in that folder"
    systems = getattr(a, "systems", ["llama"] if a.cmd == "compute" else [])
    if a.cmd == "run":
        if not Path(a.model).is_dir():
            return f"--model {a.model}: no such folder"
        if "llama" in systems and not (a.gguf and Path(a.gguf).is_file()):
            return f"--gguf {a.gguf}: the bf16 GGUF is needed for the llama system and is not a file"
        if "llama-q4" in systems and not (a.gguf_q4 and Path(a.gguf_q4).is_file()):
            return f"--gguf-q4 {a.gguf_q4}: the Q4_K_M GGUF is needed for llama-q4 and is not a file"
        for b in a.budgets:
            try:
                budget_limit(b, 1, 1 if (a.gguf_q4 or a.q4_bytes) else None)
            except ValueError as exc:
                return f"--budgets: {exc}"
    if a.isa == "avx2" and "avx2" not in cpu_row()["cpu_flags"]:
        return "--isa avx2: this CPU has no AVX2 (/proc/cpuinfo)"
    uses_llama = a.cmd == "quantize" or any(s in LLAMA_SYSTEMS for s in systems)
    if uses_llama:
        if a.isa == "avx2" and not a.llama_path and a.cmd != "quantize":
            return "--isa avx2: give --llama-path, a llama-cpp-python build without AVX-512"
        try:
            info = probe(a.llama_path)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            return f"--llama-path {a.llama_path or '(installed llama-cpp-python)'}: llama_cpp does not import: {exc}"
        if a.cmd != "quantize":
            return check_llama_build(a.isa, info, a.llama_path)
    return None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=str(Path.home() / ".cache/expertcache/bench-models/olmoe-1b-7b-L16-e1"))
    common.add_argument("--gguf", default=None, help="llama.cpp's bf16 GGUF of the checkpoint")
    common.add_argument("--gguf-q4", default=None, help="llama.cpp's Q4_K_M GGUF of the checkpoint (quantize)")
    common.add_argument("--no-repack", action="store_true",
                        help="llama.cpp without its CPU extra buffer types (--no-repack: no Q4 repacking, no AMX); "
                             "run: the same as --llama-paths no-repack")
    common.add_argument("--llama-path", default=None,
                        help="folder holding a llama-cpp-python build (its llama_cpp package), put first on the "
                             "llama children's sys.path (default: the installed llama-cpp-python)")
    common.add_argument("--isa", choices=tuple(ISA_ENV), default="native",
                        help="avx2: expertcache children with torch's kernel libraries capped at AVX2, and "
                             "--llama-path must be a llama.cpp build without AVX-512 (checked first)")
    common.add_argument("--threads", type=int, default=1, help="threads of every child (torch and llama.cpp)")
    common.add_argument("--ec-memory", choices=("auto", "reserve"), default="auto",
                        help="expertcache's --memory in its cgroup: auto (reads the limit; default) or reserve "
                             "(limit − 0.5 GiB, the earlier rows)")
    common.add_argument("--accel-dir", default=None)
    common.add_argument("--tokens", type=int, default=8)
    common.add_argument("--prompt-tokens", type=int, default=4)
    common.add_argument("--readers", type=int, default=4)
    common.add_argument("--prefetch", type=int, default=8, help="spare slots of ec-lru-pf (original + LRU with prefetch), shared by all layers")
    r = sub.add_parser("run", parents=[common])
    r.add_argument("--q4-bytes", type=int, default=None,
                   help="the Q4_K_M GGUF's size for q-budgets when --gguf-q4 is not given (rows record it)")
    r.add_argument("--budgets", nargs="+", default=["0.5", "0.25", "1.0"],
                   help="cgroup limits: fractions of the bf16 checkpoint (0.5) or of the Q4_K_M GGUF (q0.5)")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--first-round", type=int, default=0, help="number of the first round (more rounds appended later)")
    r.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["ec-lru", "ec-lru-pf", "ec-cp", "llama", "accelerate"])
    r.add_argument("--low-readahead", type=int, default=128, help="llama.cpp's second read_ahead_kb")
    r.add_argument("--low-readahead-only", action="store_true",
                   help="run llama.cpp only at --low-readahead (its better setting on this VM), not at the default")
    r.add_argument("--accel-tokens", type=int, default=2,
                   help="accelerate's timed tokens (after the prompt, no extra warm-up token: it reads every "
                        "offloaded layer whole per token)")
    r.add_argument("--llama-paths", nargs="+", choices=LLAMA_PATHS, default=None,
                   help="llama.cpp's CPU paths to run in every round (default: repack, or no-repack with --no-repack); "
                        "the summary's llama-q4-best is the faster")
    r.add_argument("--no-prime", action="store_true",
                   help="no prime run before the rounds (the quantised sidecar and dense cache exist already)")
    r.add_argument("--prime-timeout", type=int, default=3600, help="seconds for a prime run (it may quantise the model)")
    r.add_argument("--device", default="vda")
    r.add_argument("--timeout", type=int, default=420)
    r.add_argument("--out", default=None)
    c = sub.add_parser("child", parents=[common])
    c.add_argument("--system", choices=SYSTEMS, required=True)
    c.add_argument("--limit", type=int, required=True)
    c.add_argument("--resident", action="store_true", help="expertcache: C = N, all experts loaded first")
    m = sub.add_parser("compute", parents=[common])
    m.add_argument("--rounds", type=int, default=3)
    m.add_argument("--out", default=None)
    v = sub.add_parser("convert", parents=[common])
    v.add_argument("--vendor", required=True, help="vendor/llama.cpp folder of the llama-cpp-python sdist")
    v.add_argument("--outtype", choices=("bf16", "f16", "f32"), default="bf16", help="the GGUF's float type")
    q = sub.add_parser("quantize", parents=[common])  # --threads: the quantiser's
    q.add_argument("--ftype", choices=QUANT_FTYPES, default="Q4_K_M",
                   help="llama.cpp's quantisation type (written to --gguf-q4)")
    pa = sub.add_parser("prepare-accelerate", parents=[common])
    pa.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 1.0])
    s = sub.add_parser("summary")
    s.add_argument("rows", nargs="+")
    a = p.parse_args(argv)
    from expertcache.results import check_rows_out

    check_rows_out(p, getattr(a, "out", None))  # rows go to a row file only: never appended to notes.md
    if a.cmd == "run" and a.llama_paths is None:
        a.llama_paths = ["no-repack"] if a.no_repack else ["repack"]
    why = check_args(a, llama_system_info) if a.cmd in ("run", "compute", "quantize") else None
    if why:  # before the work: one line naming the culprit, exit 2
        p.exit(2, f"bench_peers.py: error: {why}\n")
    {"run": orchestrate, "child": child, "compute": compute, "convert": convert, "quantize": quantize,
     "prepare-accelerate": prepare_accelerate,
     "summary": print_summary}[a.cmd](a)


if __name__ == "__main__":
    main()
