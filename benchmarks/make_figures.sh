#!/usr/bin/env bash
# Reproduce the figures and result tables of docs/ (docs/EVAL.md describes them) and of BENCHMARKS.md.
#
#   benchmarks/make_figures.sh                  # into out/make-figures/{results,figures}/ (git ignores out/)
#   benchmarks/make_figures.sh --out DIR        # into DIR/{results,figures}/
#   benchmarks/make_figures.sh --update-docs    # rewrite the tracked files: docs/results, docs/figures and the
#                                               # shipped demo trace src/expertcache/assets/traces/
#   benchmarks/make_figures.sh --benchmarks     # instead: rerun BENCHMARKS.md's speed measurements that need no
#                                               # root, GPU or multi-GiB checkpoint, into OUT/benchmarks/*.jsonl,
#                                               # and print the commands of the others (~40 min on one idle core)
#   WT_LIMIT=16 MMLU_LIMIT=200 GRID=50 benchmarks/make_figures.sh   # bigger runs
#   COARSE=0 CLOSED_SIZES=0 benchmarks/make_figures.sh              # skip the coarse model / closed-loop cache sizes
#
# Shipped models, small sizes: ~35-50 min on one idle CPU core. Without --update-docs nothing tracked by git is
# touched (the demo trace is recorded into the output folder too).
#
# Steps: record the demo trace from the shipped granular model (original routing, 4096 WikiText tokens,
# also the default trace of `expertcache simulate`), open-loop sweeps on it, closed-loop sweeps of the
# patched models on WikiText / MMLU / GSM8K, the 001 Fig. 2 sensitivity curves, a hit/miss raster,
# `expertcache report` on every result file, and BENCHMARKS.md's quality against miss rate (every policy, both
# models, C = N/2 and N/4; benchmarks/bench_quality.py prints its tables). Results are recomputed from scratch
# (old rows are removed, set KEEP=1 to resume instead). Data: $EXPERTCACHE_DATA or ../shared/data.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=out/make-figures
UPDATE_DOCS=0
BENCH=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) [[ $# -ge 2 && -n "$2" ]] || { echo "make_figures.sh: --out needs a folder" >&2; exit 2; }; OUT=$2; shift 2 ;;
    --update-docs) UPDATE_DOCS=1; shift ;;
    --benchmarks) BENCH=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "make_figures.sh: unknown argument '$1' (use --out DIR, --update-docs or --benchmarks)" >&2; exit 2 ;;
  esac
done

DATA=${EXPERTCACHE_DATA:-../shared/data}
if [[ $BENCH == 0 && -z "${EXPERTCACHE_CMD:-}" && ! -d "$DATA/wikitext-2-raw-v1" ]]; then  # EXPERTCACHE_CMD=echo: a dry run reads nothing
  echo "make_figures.sh: no evaluation data at $DATA (needs wikitext-2-raw-v1/, mmlu/, gsm8k/): set EXPERTCACHE_DATA=DIR" \
       "(this script takes no --data-dir)" >&2
  exit 2
fi

WT_LIMIT=${WT_LIMIT:-4}        # WikiText chunks (of the model's context: 256 tokens for the shipped models)
MMLU_LIMIT=${MMLU_LIMIT:-50}   # MMLU questions (interleaved over subjects)
GSM_LIMIT=${GSM_LIMIT:-8}      # GSM8K problems
GRID=${GRID:-11}               # closed-loop points for p / lambda in [0, 1] (001 uses 50)
OPEN_GRID=${OPEN_GRID:-50}     # open-loop points (cheap)
COARSE=${COARSE:-1}            # also sweep / perturb the coarse (Mixtral) model
CLOSED_SIZES=${CLOSED_SIZES:-1}  # closed-loop WikiText over cache sizes (001 Fig. 10 in closed loop)
if [[ "$UPDATE_DOCS" == 1 ]]; then
  TRACE=src/expertcache/assets/traces/granular-wikitext2.trace.safetensors
  RES=docs/results
  FIG=docs/figures
else
  TRACE=$OUT/granular-wikitext2.trace.safetensors
  RES=$OUT/results
  FIG=$OUT/figures
fi
echo "== writing results to $RES, figures to $FIG, demo trace to $TRACE"
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
EC=(nice -n 10 python -m expertcache.cli.main)
[[ -n "${EXPERTCACHE_CMD:-}" ]] && read -ra EC <<< "$EXPERTCACHE_CMD"   # another runner (tests use 'echo')
PY=(nice -n 10 python)
[[ -n "${PYTHON_CMD:-}" ]] && read -ra PY <<< "$PYTHON_CMD"             # likewise for the benchmark scripts

if [[ "$BENCH" == 1 ]]; then
  # BENCHMARKS.md's speed tables, each section's command at its documented settings (1 thread, interleaved).
  B=$OUT/benchmarks
  echo "== writing benchmark rows to $B"
  mkdir -p "$B"
  rm -rf "$B"/{core,patch,offload,liveview,budget,serve}.jsonl "$B/tiers"
  for i in 1 2 3; do
    "${PY[@]}" benchmarks/bench_core.py --tokens 30000 --repeats 3 --out "$B/core.jsonl"
    "${PY[@]}" benchmarks/bench_patch.py --repeats 9 --mode both --out "$B/patch.jsonl"
    "${PY[@]}" benchmarks/bench_offload.py --only granular --tokens 32 --repeats 1 --out "$B/offload.jsonl"
  done
  "${PY[@]}" benchmarks/bench_offload.py --only ppl --out "$B/offload.jsonl"
  "${PY[@]}" benchmarks/bench_overhead.py --tokens 32 --rounds 5 --out "$B/overhead.jsonl"
  "${PY[@]}" benchmarks/bench_liveview.py --runs 15 --tokens 64 --out "$B/liveview.jsonl"
  "${PY[@]}" benchmarks/bench_serve_hostile.py --repeats 2 --tokens 150 --out "$B/serve-hostile.jsonl"
  "${PY[@]}" benchmarks/bench_budget.py --repeats 5 --out "$B/budget.jsonl"
  "${PY[@]}" benchmarks/bench_serve.py --model granular --concurrency 1 4 16 32 --tokens 32 --rounds 2 --repeats 2 \
    --out "$B/serve.jsonl"
  "${PY[@]}" benchmarks/bench_tiers.py --tokens 1024 --repeats 4 --lams 0,0.1,0.2,0.3,0.5,0.75,1.0 --out "$B/tiers"
  cat <<'EOF'
== not run here (root and llama.cpp, a 3.5-14 GB checkpoint, a fine-tuned model or a GPU): run by hand, as
   BENCHMARKS.md gives them
   sudo python benchmarks/bench_peers.py run ...            # decode speed against peers under a memory limit
   python benchmarks/bench_peers.py compute ...             # all-resident, against llama.cpp
   expertcache bench --model .../olmoe-1b-7b-L4-e1 ...      # the runtime against its physical floor
   python benchmarks/bench_serve.py --model .../olmoe-1b-7b-L4-e1 ...   # serving the OLMoE-shape model
   python benchmarks/gpu_check.py --out-dir gpu-report       # the GPU table (a CUDA device)
   python benchmarks/bench_melinoe.py ...                   # MELINOE (after `expertcache melinoe finetune`)
   python benchmarks/bench_tiers_project.py ...             # tiers projected onto 12 MiB experts
   python benchmarks/budget_report.py ...                   # miss-rate controller against fixed strengths
   python benchmarks/bench_quant.py ...                     # quantised experts: kernel time, C = N decode, quality
   python benchmarks/bench_kernels.py ...                   # which 4-bit kernel on which CPU (both ISAs, ~20 min)
   python benchmarks/bench_lsq.py --rounds 5                # the q4 preset's least-squares fit: torch vs compiled (~10 min)
   python benchmarks/bench_decode_breakdown.py generate ... # where a decode token's time goes, per module (an 8-layer checkpoint)
   python benchmarks/startup_timeline.py generate ...       # a second start's time to first token, by phase
   python benchmarks/bench_fused_moe.py --rounds 5          # the fused MoE step (q4moe) against per-expert products
   python benchmarks/bench_llama_quality.py --model ...     # quality like for like with llama.cpp (granular-256, trained)
   python benchmarks/bench_mixed.py quality ...             # mixed precision: closed-loop perplexity per rule
   sudo python benchmarks/bench_mixed.py speed ...          # mixed precision: OLMoE shape in a memory cgroup
   python benchmarks/mixed_report.py ...                    # its tables and the perplexity-vs-tok/s figure
EOF
  ls -l "$B"
  exit 0
fi

mkdir -p "$RES" "$FIG"
if [[ "${KEEP:-0}" != 1 ]]; then
  # only this script's outputs (other tools write into docs/figures too, e.g. analysis_*.png)
  rm -f "$RES"/{open-loop,closed-loop,sensitivity,raster-runs}*.jsonl "$RES"/*-pareto.md "$RES"/*.trace.safetensors \
        "$FIG"/{open-loop,closed-loop,sensitivity}-*.png "$FIG"/granular-wikitext-raster.png
fi

echo "== 1. demo trace (original routing, granular, 4096 WikiText tokens)"
"${EC[@]}" trace record --model granular --task wikitext --tokens 4096 --out "$TRACE"
"${EC[@]}" trace info "$TRACE"

echo "== 2. open-loop sweeps on the demo trace"
"${EC[@]}" sweep --trace "$TRACE" --policies original,prune,max-rank,cumsum,cache-prior --grid "$OPEN_GRID" \
  --capacity 0.5 --eviction lru --out "$RES/open-loop-granular.jsonl" --no-progress
"${EC[@]}" sweep --trace "$TRACE" --policies original,cache-prior --grid 21 \
  --capacity 1,2,4,8,12,16,24,32 --eviction lru --out "$RES/open-loop-granular-cache-sizes.jsonl" --no-progress

echo "== 3. closed-loop WikiText sweeps (granular, coarse)"
MODELS=(granular); [[ "$COARSE" == 1 ]] && MODELS+=(coarse)
for M in "${MODELS[@]}"; do
  "${EC[@]}" sweep --model $M --task wikitext --limit "$WT_LIMIT" --policies original,prune,max-rank,cumsum,cache-prior \
    --grid "$GRID" --capacity 0.5 --out "$RES/closed-loop-$M-wikitext.jsonl" --no-progress
done
if [[ "$CLOSED_SIZES" == 1 ]]; then
  "${EC[@]}" sweep --model granular --task wikitext --limit "$WT_LIMIT" --policies original,cache-prior --grid "$GRID" \
    --capacity 2,4,8,16,24,32 --out "$RES/closed-loop-granular-wikitext-cache-sizes.jsonl" --no-progress
fi

echo "== 4. closed-loop MMLU and GSM8K (granular)"
"${EC[@]}" sweep --model granular --task mmlu --limit "$MMLU_LIMIT" --policies original,cache-prior --grid 6 \
  --capacity 0.5 --out "$RES/closed-loop-granular-mmlu.jsonl" --no-progress
"${EC[@]}" sweep --model granular --task gsm8k --limit "$GSM_LIMIT" --policies original,cache-prior \
  --strengths 0.25,0.5,0.75 --capacity 0.5 --out "$RES/closed-loop-granular-gsm8k.jsonl" --no-progress

echo "== 5. sensitivity (001 Fig. 2)"
for M in "${MODELS[@]}"; do
  "${EC[@]}" sensitivity --model $M --limit "$WT_LIMIT" --out "$RES/sensitivity-$M.jsonl" \
    --fig "$FIG/sensitivity-$M.png" --no-progress
done

echo "== 6. hit/miss raster (001 Fig. 7): closed-loop traces, original vs cache-prior"
"${EC[@]}" eval --model granular --task wikitext --limit 2 --capacity 0.5 --no-progress \
  --trace-out "$RES/granular-original.trace.safetensors" --out "$RES/raster-runs.jsonl"
"${EC[@]}" eval --model granular --task wikitext --limit 2 --capacity 0.5 --no-progress --policy cache-prior --lam 0.5 \
  --trace-out "$RES/granular-cache-prior-0.5.trace.safetensors" --out "$RES/raster-runs.jsonl"

echo "== 7. reports"
report() {  # report PREFIX ROWS... [-- extra args]
  local prefix=$1; shift
  "${EC[@]}" report "$@" --out-dir "$FIG" --prefix "$prefix-" > /dev/null
  mv "$FIG/$prefix-pareto.md" "$RES/$prefix-pareto.md" 2>/dev/null || true
}
report open-loop-granular "$RES/open-loop-granular.jsonl" "$RES/open-loop-granular-cache-sizes.jsonl"
report closed-loop-granular-wikitext "$RES"/closed-loop-granular-wikitext*.jsonl
[[ "$COARSE" == 1 ]] && report closed-loop-coarse-wikitext "$RES/closed-loop-coarse-wikitext.jsonl"
report closed-loop-granular-mmlu "$RES/closed-loop-granular-mmlu.jsonl"
report closed-loop-granular-gsm8k "$RES/closed-loop-granular-gsm8k.jsonl"
"${EC[@]}" report --out-dir "$FIG" --prefix granular-wikitext- --layer 0 --start 256 --tokens 120 \
  --trace "$RES/granular-original.trace.safetensors=original routing (LRU)" \
  --trace "$RES/granular-cache-prior-0.5.trace.safetensors=cache-prior λ=0.5, J=1"
rm -f "$RES"/*.trace.safetensors   # large and re-creatable; the raster PNG is what is kept

echo "== 7. activation profiling of the demo trace (003 Fig. 3, 4, 6; docs/ANALYSIS.md)"
"${EC[@]}" analyze "$TRACE" --out-dir "$FIG"

echo "== 8. quality against miss rate, every policy, C = N/2 and N/4 (BENCHMARKS.md)"
ALL=original,prune,max-rank,cumsum,cache-prior,eras-threshold,eras-bias
[[ "${KEEP:-0}" != 1 ]] && rm -f "$RES"/closed-loop-*-wikitext-all-policies.jsonl
for M in "${MODELS[@]}"; do
  if [[ $M == granular ]]; then FREQ=$TRACE; else
    FREQ=$OUT/$M-wikitext2.trace.safetensors   # ERAS-bias's activation profile: a trace of the same model
    "${EC[@]}" trace record --model $M --task wikitext --tokens 4096 --out "$FREQ"
  fi
  "${EC[@]}" sweep --model $M --task wikitext --limit "$WT_LIMIT" --policies $ALL --grid "$GRID" --capacity 0.5,0.25 \
    --freq-from "$FREQ" --threads 1 --out "$RES/closed-loop-$M-wikitext-all-policies.jsonl" --no-progress
  "${EC[@]}" report "$RES/closed-loop-$M-wikitext-all-policies.jsonl" --out-dir "$RES/all-policies" \
    --prefix closed-loop-$M-wikitext-all-policies- > /dev/null
done
[[ -z "${EXPERTCACHE_CMD:-}" ]] && "${PY[@]}" benchmarks/bench_quality.py "$RES"/closed-loop-*-wikitext-all-policies.jsonl
ls -l "$FIG" "$RES"
