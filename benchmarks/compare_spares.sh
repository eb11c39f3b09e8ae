#!/bin/bash
# Prefetch spares under a fixed memory: C = 32 without spares vs C = 30 + P = 8 and C = 28 + P = 16 spares
# (spares and the scratch slot are shared by the 4 layers: 4·C + 1 + P = 129 slots in all three) vs C = 32 +
# P = 16 (more memory); OLMoE-1B-7B shapes, 4 layers, O_DIRECT, 4 readers, 1 thread; interleaved.
#   PASSES=2 bash benchmarks/compare_spares.sh
set -e
HERE=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$HERE/benchmarks/results/offload_spares.jsonl}
M=${MODEL:-$HOME/.cache/expertcache/bench-models/olmoe-1b-7b-L4-e1}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH=$HERE/src
for pass in $(seq 1 ${PASSES:-2}); do
  for cfg in "32 0" "30 8" "28 16" "32 16"; do
    set -- $cfg
    nice -n 10 python -m expertcache.cli.main bench --model "$M" --cache-experts $1 --prefetch $2 --threads 1 \
      --policies original+lru cache-prior --tokens 24 --repeats 1 --out /tmp/spares_rows.jsonl > /dev/null
    python - "$1" "$2" "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open("/tmp/spares_rows.jsonl")]
with open(sys.argv[3], "a") as f:
    for r in rows[-2:]:
        f.write(json.dumps(dict(r, label=f"C{sys.argv[1]}-P{sys.argv[2]}")) + "\n")
PY
  done
done
python - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for lab in ("C32-P0", "C30-P8", "C28-P16", "C32-P16"):
    for name in ("original+lru", "cache-prior"):
        rs = [r for r in rows if r["label"] == lab and r["name"] == name]
        if rs:
            print(f"{lab} {name:<13} tok/s {statistics.median(r['tok_s'] for r in rs):5.2f} ({' '.join('%.2f' % r['tok_s'] for r in rs)}) "
                  f"MiB/token {statistics.median(r['bytes_per_token'] for r in rs) / 2**20:6.1f} hit {statistics.median(r['hit_rate'] for r in rs):.3f} "
                  f"measured/floor {statistics.median(r['floor_ratio'] for r in rs):.2f} plan {rs[0]['config']['memory']['total'] / 2**20:.0f} MiB")
PY
