#!/bin/bash
# All-resident decode ms/token, interleaved: a base commit's runtime, this tree's, and (when GGUF is set)
# llama.cpp on a GGUF of the same weights; OLMoE-1B-7B shapes, 4 layers, 1 thread, nice. Rows: $OUT.
#   git worktree add /tmp/rt-base 97551c4
#   expertcache bench --make-model olmoe-1b-7b --layers 4
#   GGUF=/tmp/olmoe-L4-bf16.gguf PASSES=4 bash benchmarks/compare_resident.sh
set -e
HERE=$(cd "$(dirname "$0")/.." && pwd)
BASE=${BASE:-/tmp/rt-base}
OUT=${OUT:-$HERE/benchmarks/results/resident.jsonl}
M=${MODEL:-$HOME/.cache/expertcache/bench-models/olmoe-1b-7b-L4-e1}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for pass in $(seq 1 ${PASSES:-4}); do
  PYTHONPATH=$BASE/src nice -n 10 python "$HERE/benchmarks/bench_resident.py" --model "$M" --label base --out "$OUT"
  PYTHONPATH=$HERE/src nice -n 10 python "$HERE/benchmarks/bench_resident.py" --model "$M" --label this --out "$OUT"
  if [ -n "$GGUF" ]; then
    PYTHONPATH=$HERE/src nice -n 10 python "$HERE/benchmarks/bench_resident.py" --gguf "$GGUF" --label llama.cpp --out "$OUT"
  fi
done
PYTHONPATH=$HERE/src python - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for key in ("ms_per_token", "cpu_ms_per_token"):
    med = {}
    for lab in ("base", "this", "llama.cpp"):
        rs = [r[key] for r in rows if r["label"] == lab and key in r]
        if rs:
            med[lab] = statistics.median(rs)
            print(f"{key:>17} {lab:>10}: {med[lab]:6.1f} (median of {len(rs)} runs: {' '.join(f'{x:.1f}' for x in rs)})")
    # per pass ratios (rows are appended base, this, llama.cpp per pass)
    by = {lab: [r[key] for r in rows if r["label"] == lab and key in r] for lab in ("base", "this", "llama.cpp")}
    for a, b in (("this", "base"), ("base", "llama.cpp"), ("this", "llama.cpp")):
        pr = [x / y for x, y in zip(by[a], by[b])]
        if pr:
            print(f"{key:>17} {a} / {b}: median of per-pass ratios {statistics.median(pr):.2f} ({' '.join(f'{x:.2f}' for x in pr)})")
PY
