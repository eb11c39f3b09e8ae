"""Mixed precision: a miss served at 4 bits instead of waited for (issue 37, ``--resident-quant int4``).

    nice -n 10 python benchmarks/bench_mixed.py quality [--chunks 4] [--model granular] [--dataset heldout]
    nice -n 10 python benchmarks/bench_mixed.py mmlu [--questions 100] [--shots 5] [--model granular]
    nice -n 10 python benchmarks/bench_mixed.py speed [--layers 16] [--tokens 16] [--repeats 3] [--fraction 0.5]

1. **quality**: closed-loop perplexity of a shipped model on WikiText-2 test or (``--dataset heldout``) the
   project's held-out split of corpus-debian-docs (``--chunks`` chunks of 256 tokens from /work/shared/data, the
   caches carried across chunks), token by token through the offloaded runtime at
   C = N/4 (teacher-forced decode: each token's routing sees the live residency), for full precision (original +
   LRU, Cache-Prior), all-int4 (every miss at low precision and nothing ever loaded: equal to ``--quant int4``,
   ``tests/test_mixed_precision.py``), the mixed tier with each rule (router weight below a threshold, a per-token
   load budget, with and without promotion), and the mixed tier with Cache-Prior / cache-prior-cost. Counts per
   row: full-precision hits, low-precision computes, loads (per token and MoE layer). One runtime (the int4
   copies resident), re-configured per row: deterministic, so one pass.
   **mmlu**: closed-loop MMLU accuracy of a subset of those rows (:func:`mmlu_names`): ``expertcache eval``'s MMLU
   prompts (``--shots``, as many as fit the model's context) and scoring (``MMLUTask.score``), each prompt token
   by token through the same runtime, the caches carried across questions; the first ``--questions`` test
   questions (interleaved across subjects), the same for every row, whose predicted letters are recorded so
   rows compare question by question.
2. **speed**: the random-weight OLMoE-1B-7B-shape checkpoint with ``--layers`` layers (16: 13.8 GB bf16;
   ``expertcache bench --make-model olmoe-1b-7b --layers 16``), each configuration one process alone in a v1
   memory cgroup of ``--fraction`` × the checkpoint's bf16 size (its ``--memory`` = that limit minus
   ``--headroom``, the interpreter's own memory), disk tier with O_DIRECT reads, ``--tokens`` teacher-forced
   tokens after a 16-token prompt, one thread, nothing warmed; configurations in alternating order over
   ``--repeats`` rounds, medians. The configurations carry the quality rows' names (Cache-Prior λ 0.2; budgets
   in experts per token and MoE layer), so a figure can pair granular's perplexity with this tok/s; a
   random-weight router spreads its weight almost evenly (OLMoE's top-8 of 64, not renormalised: weights ≈
   0.02-0.06), so the threshold row uses its own ``--speed-threshold``.

Rows go to benchmarks/results/mixed.jsonl (``--out``); markdown tables print ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from expertcache.offload.bench import closed_loop_nll, machine_info
from expertcache.jsonsafe import loads
from expertcache.results import append_jsonl

OUT = Path(__file__).resolve().parent / "results" / "mixed.jsonl"


def quality_configs(expert_bytes: int, threshold: float, low_cost: float):
    """name -> (routing, precision rule) of the quality rows."""
    from expertcache.routing import RoutingConfig
    from expertcache.routing.precision import NEVER, PrecisionRule

    orig, cp = RoutingConfig(), RoutingConfig("cache-prior", lam=0.2)
    cost = RoutingConfig("cache-prior-cost", lam=0.2)
    t = threshold
    return {
        "bf16 original+LRU": (orig, NEVER),
        "bf16 Cache-Prior": (cp, NEVER),
        "all-int4": (orig, PrecisionRule(threshold=2.0)),
        f"mixed w<{t/2:g}": (orig, PrecisionRule(threshold=t / 2)),
        f"mixed w<{t:g}": (orig, PrecisionRule(threshold=t)),
        f"mixed w<{2*t:g}": (orig, PrecisionRule(threshold=2 * t)),
        f"mixed w<{t:g} promote 4": (orig, PrecisionRule(threshold=t, promote=4)),
        "mixed budget 2": (orig, PrecisionRule(budget=2 * expert_bytes)),
        "mixed budget 1": (orig, PrecisionRule(budget=expert_bytes)),
        f"mixed w<{t:g} + Cache-Prior": (cp, PrecisionRule(threshold=t)),
        f"mixed w<{2*t:g} + Cache-Prior": (cp, PrecisionRule(threshold=2 * t)),
        "mixed budget 1 + Cache-Prior": (cp, PrecisionRule(budget=expert_bytes)),
        f"mixed w<{t:g} + cache-prior-cost {low_cost:g}": (cost, PrecisionRule(threshold=t, cost=low_cost)),
        f"mixed w<{2*t:g} + cache-prior-cost {low_cost:g}": (cost, PrecisionRule(threshold=2 * t, cost=low_cost)),
    }


DATASETS = ("wikitext", "heldout")


def quality_ids(dataset: str, path: Path) -> list[int]:
    """Token ids of the quality text: ``wikitext`` WikiText-2 raw test (the rows joined by blank lines), or
    ``heldout`` the project's held-out split of corpus-debian-docs (``expertcache.train.data.split_documents``:
    its first 64 documents, each followed by EOS, as ``bench_offload.py quant-ppl`` scores them)."""
    if dataset == "heldout":
        from expertcache.offload.bench import heldout_stream

        return heldout_stream(path).astype("int64").tolist()
    from tokenizers import Tokenizer

    from expertcache.eval.data import resolve_eval_data_dir, wikitext_text

    text = wikitext_text(resolve_eval_data_dir("wikitext"))
    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def quality_rows(model: str, chunks: int, threshold: float, low_cost: float, log, seq: int = 256,
                 dataset: str = "wikitext") -> list[dict]:
    from expertcache.models.loader import resolve_model_path
    from expertcache.offload import OffloadConfig, OffloadedModel

    path = resolve_model_path(model)
    ids = quality_ids(dataset, path)
    if len(ids) < chunks * seq:
        print(f"bench_mixed.py: error: --chunks {chunks}: the {dataset} text has {len(ids)} tokens, fewer than "
              f"{chunks} chunks of {seq}", file=sys.stderr)
        raise SystemExit(2)
    chunks_NS = torch.tensor(ids[:chunks * seq]).view(chunks, seq)
    rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", resident_quant="int4", context=seq))
    capacity = rt.num_experts // 4
    rows = []
    for name, (routing, rule) in quality_configs(rt.expert_bytes, threshold, low_cost).items():
        rt.configure(routing=routing, capacity=capacity, precision=rule)
        t0 = time.perf_counter()
        chunk_nll = [closed_loop_nll(rt, chunk_1S)[0] for chunk_1S in chunks_NS.split(1)]  # caches carried on
        nll, count = sum(chunk_nll), chunks * (seq - 1)
        s = rt.stats()
        per = count * len(rt.layers)  # token-layer steps (the prefill's first tokens included in the counts)
        row = dict(kind="mixed-quality", model=model, dataset=dataset, name=name, routing=routing.label(), rule=rule.to_dict(),
                   capacity=rt.capacity, num_experts=rt.num_experts, top_k=rt.top_k, ppl=math.exp(nll / count),
                   tokens=count, fp_hits=s["hits"], low_computes=s["low_computes"], loads=s["misses"],
                   loads_per_token_layer=s["misses"] / per, low_per_token_layer=s["low_computes"] / per,
                   fp_hits_per_token_layer=s["hits"] / per, expert_bytes=rt.expert_bytes,
                   low_tier_bytes=rt.plan.low_tier_bytes, chunk_nll=chunk_nll, seconds=time.perf_counter() - t0)
        log(f"{name:<40} ppl {row['ppl']:.3f}  hits {s['hits']}  int4 {s['low_computes']}  loads {s['misses']}"
            f"  ({row['seconds']:.0f} s)")
        rows.append(row)
    rt.close()
    return rows


def mmlu_names(threshold: float, low_cost: float) -> tuple[str, ...]:
    """The quality rows that MMLU scores (a subset: token by token, MMLU's prompts cost ~250 forwards each)."""
    t = threshold
    return ("bf16 original+LRU", "bf16 Cache-Prior", "all-int4", f"mixed w<{t:g}", f"mixed w<{t:g} + Cache-Prior",
            f"mixed w<{t:g} + cache-prior-cost {low_cost:g}")


def mmlu_rows(model: str, questions: int, shots: int, threshold: float, low_cost: float, log) -> list[dict]:
    """Closed-loop MMLU accuracy of :func:`mmlu_names`: ``expertcache eval``'s MMLU task (its prompts, k-shot
    fitted to the model's context, and its scoring :meth:`MMLUTask.score`) with each question's prompt fed token
    by token through the offloaded runtime at C = N/4, the caches carried across questions; every row scores
    the same first ``questions`` test questions (interleaved across subjects), so rows compare pairwise."""
    from expertcache.eval.tasks import MMLUTask
    from expertcache.models.loader import load_tokenizer_checked, read_config_json, resolve_model_path
    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.offload.bench import closed_loop_mmlu

    path = resolve_model_path(model)
    context = min(1024, read_config_json(path).get("max_position_embeddings") or 1024)  # eval's context_length
    task = MMLUTask(load_tokenizer_checked(path), context=context, limit=questions, shots=shots)  # shared data
    tokens = sum(len(p) for p in task.prompts)
    log(f"mmlu: {len(task)} questions, {task.info['subjects']} subjects, {shots}-shot fitted to {context} tokens "
        f"(mean {task.info['mean_shots']:.2f} shots), {tokens} tokens per configuration")
    rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", resident_quant="int4", context=context))
    capacity = rt.num_experts // 4
    configs = quality_configs(rt.expert_bytes, threshold, low_cost)
    rows = []
    for name in mmlu_names(threshold, low_cost):
        routing, rule = configs[name]
        rt.configure(routing=routing, capacity=capacity, precision=rule)
        t0 = time.perf_counter()
        res = closed_loop_mmlu(rt, task, lambda i, c: print(f"  {name}: {i + 1}/{len(task)} questions, {c} right",
                                                             end="\r", flush=True))
        s, n, correct = rt.stats(), len(task), res["correct"]
        per = tokens * len(rt.layers)  # token-layer steps
        acc = correct / n
        row = dict(kind="mixed-mmlu", model=model, dataset="mmlu", name=name, routing=routing.label(),
                   rule=rule.to_dict(), capacity=rt.capacity, num_experts=rt.num_experts, top_k=rt.top_k,
                   questions=n, shots=shots, mean_shots=task.info["mean_shots"], context=context, tokens=tokens,
                   correct=correct, accuracy=acc, se=math.sqrt(acc * (1 - acc) / n),
                   mean_answer_loglik=res["mean_answer_loglik"], predictions=res["predictions"],
                   answers=list(task.answers), fp_hits=s["hits"], low_computes=s["low_computes"], loads=s["misses"],
                   loads_per_token_layer=s["misses"] / per, low_per_token_layer=s["low_computes"] / per, fp_hits_per_token_layer=s["hits"] / per,
                   seconds=time.perf_counter() - t0)
        log(f"{name:<40} accuracy {acc:.3f} ± {row['se']:.3f}  answer log-p {row['mean_answer_loglik']:.3f}  "
            f"hits {s['hits']}  int4 {s['low_computes']}  loads {s['misses']}  ({row['seconds']:.0f} s)")
        rows.append(row)
    rt.close()
    return rows


# -- speed --------------------------------------------------------------------------------------------------


SPEED_CONFIGS = ("bf16 Cache-Prior", "bf16 original+LRU", "all-int4", "mixed budget 1 + Cache-Prior",
                 "mixed budget 2", "mixed w<T + Cache-Prior")


def speed_config(name: str, expert_bytes: int, threshold: float):
    """(OffloadConfig fields, routing) of the speed configuration ``name`` (the quality rows' names; ``all-int4``
    here is ``--quant int4`` in the slots, which the quality rows equal by every miss at 4 bits with an empty
    cache, tests/test_mixed_precision.py; ``w<T``: the threshold ``--speed-threshold`` of this router)."""
    from expertcache.routing import RoutingConfig

    routing = RoutingConfig("cache-prior", lam=0.2) if "Cache-Prior" in name else RoutingConfig()
    if name.startswith("bf16"):
        return {}, routing
    if name == "all-int4":
        return dict(quant="int4"), routing
    fields = dict(resident_quant="int4")
    if "budget" in name:
        fields["load_budget"] = int(name.split("budget ")[1].split()[0]) * expert_bytes
    else:
        fields["low_threshold"] = threshold
    return fields, routing


def speed_one(args) -> None:
    """One configuration, in this process (run inside the cgroup by :func:`speed_rows`): build, warm-free decode
    of ``--tokens`` teacher-forced tokens after a 16-token prompt, one JSON row on stdout."""
    from expertcache.offload import OffloadConfig, OffloadedModel

    path = Path(args.path)
    fields, routing = speed_config(args.name, _expert_bytes(path), args.speed_threshold)
    t0 = time.perf_counter()
    dense = None if args.dense == "none" else args.dense
    rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="disk", io="direct",
                                                            memory="auto" if args.memory < 0 else args.memory,
                                                            context=16 + args.tokens, quant_dense=dense, **fields),
                                        routing=routing)
    build_s = time.perf_counter() - t0
    prompt = torch.randint(3, 50304, (1, 16), generator=torch.Generator().manual_seed(0))
    forced = torch.randint(3, 50304, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    marks: list[float] = []  # CPU seconds of this process (all threads) when each token is chosen: the decode's
    # CPU time, whatever share of a busy machine it got (a disk wait costs wall time, not CPU time)
    res = rt.generate(prompt, args.tokens, forced_BN=forced, on_token=lambda _: marks.append(time.process_time()))
    cpu_s = marks[-1] - marks[0]
    d, n = res["decode_stats"], max(1, res["decode_tokens"])
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    print(json.dumps(dict(tok_s=n / res["decode_s"], tokens=n, cpu_s_per_token=cpu_s / n, capacity=rt.capacity, fp_hits_per_token=d["hits"] / n,
                          low_computes_per_token=d["low_computes"] / n, loads_per_token=d["misses"] / n,
                          bytes_per_token=d["bytes_read"] / n, plan_total=rt.plan.total,
                          low_tier_bytes=rt.plan.low_tier_bytes, build_s=build_s, peak_rss=peak,
                          routing=routing.label(), quant=rt.offload.quant, resident_quant=rt.offload.resident_quant,
                          quant_dense=rt.offload.quant_dense,
                          precision=rt.describe()["precision"])))


CGROUP = Path("/sys/fs/cgroup/memory/expertcache-mixed")


def _in_cgroup(limit: int, argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``argv`` alone in the v1 memory cgroup :data:`CGROUP` limited to ``limit`` bytes, page cache dropped
    first; an OOM kill shows as its exit status (-9), never hidden."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(str(limit))
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("1")
    wrapped = ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh", *argv]
    return subprocess.run(wrapped, capture_output=True, text=True)


def speed_rows(args, log, on_row=lambda row: None) -> list[dict]:
    from expertcache.offload.make_model import make_bench_model

    path = make_bench_model("olmoe-1b-7b", layers=args.layers)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    limit = int(size * args.fraction)
    memory = limit - args.headroom * 2**20
    if memory <= 0 and not args.auto:  # never a row with a negative memory
        print(f"bench_mixed.py: error: --fraction {args.fraction:g} of {size / 2**30:.2f} GiB leaves no memory after "
              f"--headroom {args.headroom} MiB; raise --fraction or lower --headroom", file=sys.stderr)
        raise SystemExit(2)
    log(f"{path}: {size / 2**30:.2f} GiB bf16; cgroup limit {limit / 2**30:.2f} GiB, --memory {memory / 2**30:.2f} GiB")
    names = args.configs or list(SPEED_CONFIGS)
    rows = []
    for r in range(args.repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            argv = [sys.executable, __file__, "speed-one", "--path", str(path), "--name", name, "--memory",
                    str(-1 if args.auto else memory), "--dense", args.dense,
                    "--tokens", str(args.tokens), "--speed-threshold", str(args.speed_threshold), "--threads", "1"]
            t0 = time.perf_counter()
            p = _in_cgroup(limit, argv)
            base = dict(kind="mixed-speed", name=name, round=r, layers=args.layers, limit=limit,
                        memory="auto" if args.auto else memory, dense=args.dense,
                        fraction=args.fraction, process_s=time.perf_counter() - t0)
            if p.returncode != 0:
                tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
                log(f"round {r} {name}: exit {p.returncode}: {tail}")
                rows.append(dict(base, failed=p.returncode, error=tail))
                on_row(rows[-1])
                continue
            row = dict(base, **loads(p.stdout.strip().splitlines()[-1], what=f"{name} row"))
            log(f"round {r} {name:<30} {row['tok_s']:6.2f} tok/s  C={row['capacity']}  loads/token "
                f"{row['loads_per_token']:.1f}  int4/token {row['low_computes_per_token']:.1f}  "
                f"{row['bytes_per_token'] / 2**20:.0f} MiB/token  peak RSS {row['peak_rss'] / 2**30:.2f} GiB")
            rows.append(row)
            on_row(row)
    return rows


def _expert_bytes(path: Path) -> int:
    from expertcache.models.adapters import family_for
    from expertcache.models.loader import load_config_checked
    from expertcache.offload.checkpoint import Checkpoint

    config = load_config_checked(path)
    return Checkpoint(path, family_for(config).disk, config.num_experts).expert(0, 0).nbytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("quality", "mmlu", "speed", "speed-one"))
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--memory", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="granular", help="quality: shipped model")
    ap.add_argument("--chunks", type=int, default=4, help="quality: chunks of 256 tokens")
    ap.add_argument("--dataset", choices=DATASETS, default="wikitext", help="quality: WikiText-2 test or the "
                    "project's held-out split (corpus-debian-docs)")
    ap.add_argument("--questions", type=int, default=100, help="mmlu: the first N test questions")
    ap.add_argument("--shots", type=int, default=5, help="mmlu: exemplars (as many as fit the context)")
    ap.add_argument("--threshold", type=float, default=0.1, help="quality: the router-weight threshold t (rows at "
                    "t/2, t, 2t)")
    ap.add_argument("--low-cost", type=float, default=0.3, help="quality: cache-prior-cost's int4 price")
    ap.add_argument("--layers", type=int, default=16, help="speed: OLMoE-shape decoder layers")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.5, help="speed: cgroup limit as a fraction of bf16 size")
    ap.add_argument("--headroom", type=int, default=768, help="speed: MiB of the limit left to the interpreter")
    ap.add_argument("--speed-threshold", type=float, default=0.04, help="speed: the threshold of the w<T row")
    ap.add_argument("--configs", nargs="+", choices=SPEED_CONFIGS, default=None, help="speed: a subset")
    ap.add_argument("--dense", choices=("none", "int8", "int4"), default="none",
                    help="speed: --quant-dense of every configuration")
    ap.add_argument("--auto", action="store_true", help="speed: --memory auto (the cgroup's limit, the interpreter "
                    "counted) instead of the limit less --headroom")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    from expertcache.results import check_rows_out

    check_rows_out(ap, args.out)  # rows go to a row file only: never appended to notes.md
    for flag, value, least in (("--chunks", args.chunks, 1), ("--questions", args.questions, 1),
                               ("--shots", args.shots, 0), ("--threads", args.threads, 1), ("--layers", args.layers, 1),
                               ("--tokens", args.tokens, 1), ("--repeats", args.repeats, 1), ("--headroom", args.headroom, 0)):
        if value < least:
            ap.error(f"{flag} must be ≥ {least}, got {value}")
    if not 0 < args.fraction <= 4:  # 0 gave rows with a negative --memory
        ap.error(f"--fraction must be in (0, 4] (the cgroup limit as a fraction of the bf16 size), got {args.fraction:g}")
    if args.what == "speed-one" and None in (args.path, args.name, args.memory):
        ap.error("speed-one is one configuration of `speed`, run by it inside its memory cgroup (it needs --path, "
                 "--name and --memory); run `bench_mixed.py speed`")
    if not 0 < args.threshold <= 1 or not 0 <= args.low_cost <= 1:
        ap.error(f"--threshold must be in (0, 1] and --low-cost in [0, 1], got {args.threshold:g}, {args.low_cost:g}")
    torch.set_num_threads(args.threads)
    if args.what == "speed-one":
        speed_one(args)
        return 0
    info = machine_info()
    with open("/proc/loadavg") as f:
        info["loadavg"] = f.read().split()[:3]
    print(f"machine: {info}", flush=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = lambda row: append_jsonl(args.out, dict(row, bench="bench_mixed.py", machine=info, date=stamp))
    log = lambda *a: print(*a, flush=True)
    from mixed_report import mmlu_table, quality_table, speed_table  # benchmarks/mixed_report.py (this folder)

    if args.what in ("mmlu", "quality"):
        try:  # a missing model or data folder: one line, before any long work (the data is read first)
            rows = (mmlu_rows(args.model, args.questions, args.shots, args.threshold, args.low_cost, log)
                    if args.what == "mmlu" else
                    quality_rows(args.model, args.chunks, args.threshold, args.low_cost, log, dataset=args.dataset))
        except FileNotFoundError as e:
            ap.exit(2, f"bench_mixed.py: error: {e}\n")
        for r in rows:
            out(r)
        print("\n" + (mmlu_table(rows) if args.what == "mmlu" else quality_table(rows)))
    else:
        rows = speed_rows(args, log, on_row=out)  # each row as it comes
        print("\n" + speed_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
