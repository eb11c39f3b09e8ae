#!/usr/bin/env bash
# Reproduce the figures and result tables of docs/ (docs/EVAL.md describes them).
#
#   benchmarks/make_figures.sh                  # into out/make-figures/{results,figures}/ (git ignores out/)
#   benchmarks/make_figures.sh --out DIR        # into DIR/{results,figures}/
#   benchmarks/make_figures.sh --update-docs    # rewrite the tracked files: docs/results, docs/figures and the
#                                               # shipped demo trace src/expertcache/assets/traces/
#   WT_LIMIT=16 MMLU_LIMIT=200 GRID=50 benchmarks/make_figures.sh   # bigger runs
#   COARSE=0 CLOSED_SIZES=0 benchmarks/make_figures.sh              # skip the coarse model / closed-loop cache sizes
#
# Shipped models, small sizes: ~30-45 min on one idle CPU core. Without --update-docs nothing tracked by git is
# touched (the demo trace is recorded into the output folder too).
#
# Steps: record the demo trace from the shipped granular model (original routing, 4096 WikiText tokens,
# also the default trace of `expertcache simulate`), open-loop sweeps on it, closed-loop sweeps of the
# patched models on WikiText / MMLU / GSM8K, the 001 Fig. 2 sensitivity curves, a hit/miss raster, and
# `expertcache report` on every result file. Results are recomputed from scratch (old rows are removed,
# set KEEP=1 to resume instead). Data: $EXPERTCACHE_DATA or ../shared/data.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=out/make-figures
UPDATE_DOCS=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) [[ $# -ge 2 && -n "$2" ]] || { echo "make_figures.sh: --out needs a folder" >&2; exit 2; }; OUT=$2; shift 2 ;;
    --update-docs) UPDATE_DOCS=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "make_figures.sh: unknown argument '$1' (use --out DIR or --update-docs)" >&2; exit 2 ;;
  esac
done

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
ls -l "$FIG" "$RES"
