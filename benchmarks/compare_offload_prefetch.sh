#!/bin/bash
# Interleaved before/after of the overlapped runtime (issue 10, second round): per pass, a base commit's
# bench_offload.py and this tree's, both with --readers 4 --prefetch 8; OLMoE-1B-7B shapes, 4 layers,
# C = 32/64, O_DIRECT, 24 teacher-forced tokens, 1 torch thread, nice. Rows: $OUT (label = build).
#   git worktree add /tmp/rt-base 97551c4
#   expertcache bench --make-model olmoe-1b-7b --layers 4
#   PASSES=4 bash benchmarks/compare_offload_prefetch.sh
set -e
HERE=$(cd "$(dirname "$0")/.." && pwd)
BASE=${BASE:-/tmp/rt-base}
OUT=${OUT:-$HERE/benchmarks/results/offload_prefetch_compare.jsonl}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
for pass in $(seq 1 ${PASSES:-4}); do
  for build in base this ${ARMS_EXTRA}; do
    EXTRA=""
    if [ $build = base ]; then SRC=$BASE; else SRC=$HERE; fi
    if [ $build = this-pieces ]; then EXTRA=--pieces; fi   # ARMS_EXTRA=this-pieces: A/B of the piece reads
    PYTHONPATH=$SRC/src nice -n 10 python "$SRC/benchmarks/bench_offload.py" --only olmoe --layers 4 --tokens 24 \
      --repeats 1 --threads 1 --readers 4 --prefetch 8 --label $build --out "$OUT" $EXTRA
  done
done
PYTHONPATH=$HERE/src python - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
bw_all = statistics.median(r["bandwidth"] for r in rows)
print(f"device bandwidth, median over both builds' measurements: {bw_all / 1e6:.0f} MB/s")
for lab in ("base", "this", "this-pieces"):
    if not any(r["label"] == lab for r in rows):
        continue
    print(f"{lab}: bandwidth (own measurement, median) {statistics.median(r['bandwidth'] for r in rows if r['label'] == lab) / 1e6:.0f} MB/s")
    for name in ("original+lru", "cache-prior"):
        rs = [r for r in rows if r["label"] == lab and r["name"] == name]
        if not rs:
            continue
        common = [r["s_per_token"] / max(r["t_compute"], r["bytes_per_token"] / bw_all) for r in rs]
        print(f"  {name:<13} tok/s {statistics.median(r['tok_s'] for r in rs):6.2f} (" +
              " ".join(f"{r['tok_s']:.2f}" for r in rs) + f")  measured/floor {statistics.median(r['floor_ratio'] for r in rs):.2f}"
              f" (common bw {statistics.median(common):.2f})  compute {statistics.median(r['t_compute'] for r in rs) * 1e3:.0f} ms"
              f"  MiB/token {statistics.median(r['bytes_per_token'] for r in rs) / 2**20:.1f}"
              f"  prefetch P/R {statistics.median(r['prefetch_precision'] for r in rs):.2f}/{statistics.median(r['prefetch_recall'] for r in rs):.2f}")
        first = [r["prefetch_per_layer"]["0"] for r in rs if "0" in r.get("prefetch_per_layer", {})]
        if first:
            print(f"  {'':<13} first MoE layer's guess P/R {statistics.median(f['precision'] for f in first):.2f}/"
                  f"{statistics.median(f['recall'] for f in first):.2f}")
PY
