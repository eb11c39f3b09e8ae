"""All-resident decode time per token (C = N: every expert in its slot, no reads while decoding) of the
offloaded runtime -- or of llama.cpp (llama-cpp-python, optional, not in CI) on a GGUF of the same
weights -- on the same teacher-forced tokens. One JSONL row per run (median of ``--repeats`` decodes).

    python benchmarks/bench_resident.py --model DIR [--tokens 24] [--repeats 3] [--label NAME] [--out F]
    python benchmarks/bench_resident.py --gguf FILE.gguf ...        # llama.cpp, page cache warm, 1 thread

Used by benchmarks/compare_resident.sh (base commit, this tree and llama.cpp, interleaved).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from expertcache.results import append_jsonl

OUT = Path(__file__).resolve().parent / "results" / "resident.jsonl"


def expertcache_ms(path: str, tokens: int, repeats: int) -> tuple[list[float], dict]:
    from expertcache.offload import OffloadConfig, OffloadedModel

    rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="disk", io="direct", capacity=None,
                                                            context=16 + tokens))
    rt.warm()  # every expert resident
    vocab = rt.config.vocab_size
    prompt = torch.randint(3, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    forced = torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
    rt.generate(prompt, 4, forced_BN=forced)  # warm-up
    cpu = [0.0]
    decode = rt.decode_one_token

    def timed(*a):  # CPU time of the compute thread per decode step (robust to time-slicing on a shared VM)
        t0 = time.thread_time()
        try:
            return decode(*a)
        finally:
            cpu[0] += time.thread_time() - t0

    rt.decode_one_token = timed
    ms, cpu_ms = [], []
    for _ in range(repeats):
        cpu[0] = 0.0
        out = rt.generate(prompt, tokens, forced_BN=forced)
        if out["decode_stats"]["misses"]:
            raise RuntimeError("not all-resident: misses while decoding")
        ms.append(out["decode_s"] / out["decode_tokens"] * 1e3)
        cpu_ms.append(cpu[0] / out["decode_tokens"] * 1e3)
    return ms, dict(capacity=rt.capacity, num_experts=rt.num_experts, cpu_ms_runs=cpu_ms)


def llama_cpp_ms(gguf: str, tokens: int, repeats: int) -> tuple[list[float], dict]:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_threads=1, n_threads_batch=1, n_ctx=16 + tokens + 8, use_mmap=True,
                verbose=False)
    vocab = llm.n_vocab()
    prompt = torch.randint(3, vocab, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    forced = torch.randint(3, vocab, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    ms, cpu_ms = [], []
    for r in range(repeats + 1):  # the first is the warm-up (page cache, kernels)
        llm.reset()
        llm.eval(prompt)
        t0, c0 = time.perf_counter(), time.thread_time()  # n_threads=1: ggml computes on this thread
        for tok in forced[:-1]:
            llm.eval([tok])
        if r:
            ms.append((time.perf_counter() - t0) / (tokens - 1) * 1e3)
            cpu_ms.append((time.thread_time() - c0) / (tokens - 1) * 1e3)
    return ms, dict(llama_cpp=__import__("llama_cpp").__version__, cpu_ms_runs=cpu_ms)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint folder (expertcache, all experts resident)")
    src.add_argument("--gguf", help="GGUF file of the same weights (llama.cpp)")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.model:
        ms, extra = expertcache_ms(args.model, args.tokens, args.repeats)
        system = "expertcache"
    else:
        ms, extra = llama_cpp_ms(args.gguf, args.tokens, args.repeats)
        system = "llama.cpp"
    med = statistics.median(ms)
    cpu = statistics.median(extra["cpu_ms_runs"])
    row = dict(kind="resident", system=system, label=args.label or system, model=args.model or args.gguf,
               tokens=args.tokens, ms_per_token=med, ms_runs=ms, cpu_ms_per_token=cpu, tok_s=1e3 / med, threads=1,
               **extra)
    append_jsonl(args.out, row)
    print(f"{row['label']:>20}: {med:6.1f} ms/token wall ({' '.join(f'{m:.1f}' for m in ms)}), "
          f"{cpu:6.1f} ms/token CPU of the compute thread", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
