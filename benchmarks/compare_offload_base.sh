#!/bin/bash
# Interleaved side-by-side of the offloaded runtime against a base commit (issue 10 figures in BENCHMARKS.md):
# per pass, the base commit's run_bench (serial reads, all-resident reference), then this tree with
# --readers 0 (serial), --readers 4, --readers 4 --prefetch 8; OLMoE-1B-7B shapes, 4 layers, C = 32/64,
# O_DIRECT, 1 torch thread, nice. Rows go to $OUT (label = build); summarise with the python at the end.
#   git worktree add /tmp/base-rt 50dbe73
#   expertcache bench --make-model olmoe-1b-7b --layers 4
#   PASSES=6 bash benchmarks/compare_offload_base.sh
set -e
HERE=$(cd "$(dirname "$0")/.." && pwd)
BASE=${BASE:-/tmp/base-rt}
OUT=${OUT:-$HERE/benchmarks/results/offload_base_compare.jsonl}
M=${MODEL:-$HOME/.cache/expertcache/bench-models/olmoe-1b-7b-L4-e1}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
BASE_PY='
import sys, torch
from expertcache.offload import OffloadConfig
from expertcache.offload.bench import run_bench
from expertcache.results import append_jsonl
torch.set_num_threads(1)
path, tokens, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
prompt = torch.randint(3, 50304, (1, 16), generator=torch.Generator().manual_seed(0))
forced = torch.randint(3, 50304, (1, tokens), generator=torch.Generator().manual_seed(1))
run_bench(path, OffloadConfig(tier="disk", io="direct", capacity=32, context=16 + tokens),
          policies=["original+lru", "cache-prior"], prompt_BS=prompt, tokens=tokens, forced_BN=forced, repeats=1,
          on_row=lambda r: append_jsonl(out, dict(r, label="base")), log=print)'
for pass in $(seq 1 ${PASSES:-3}); do
  PYTHONPATH=$BASE/src nice -n 10 python -c "$BASE_PY" "$M" 24 "$OUT"
  for cfg in "0 0 serial" "4 0 readers4" "4 8 readers4-prefetch8"; do
    set -- $cfg
    PYTHONPATH=$HERE/src nice -n 10 python "$HERE/benchmarks/bench_offload.py" --only olmoe --layers 4 --tokens 24 \
      --repeats 1 --threads 1 --readers $1 --prefetch $2 --label $3 --out "$OUT"
  done
done
PYTHONPATH=$HERE/src python - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
bw = statistics.median(r["bandwidth"] for r in rows if r["label"] != "base")  # parallel, measured in the new runs
print(f"device bandwidth (median, 4 readers, 12 MiB reads): {bw / 1e6:.0f} MB/s")
for lab in ("base", "serial", "readers4", "readers4-prefetch8"):
    for name in ("original+lru", "cache-prior"):
        rs = [r for r in rows if r["label"] == lab and r["name"] == name]
        if not rs:
            continue
        # compute = decode time - time blocked on reads (serial builds: read time on the compute thread)
        comp = [r["s_per_token"] - r["io_s_per_token"] if lab in ("base", "serial") else r["t_compute"] for r in rs]
        ratio = [r["s_per_token"] / max(c, r["bytes_per_token"] / bw) for r, c in zip(rs, comp)]
        print(f"{lab:>20} {name:<13} tok/s {statistics.median(r['tok_s'] for r in rs):6.2f}  measured/floor "
              f"{statistics.median(ratio):.2f}  MiB/token {statistics.median(r['bytes_per_token'] for r in rs) / 2**20:6.1f}")
PY
