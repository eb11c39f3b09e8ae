"""One JSON row per compared model (``expertcache mole eval``): what docs/MOLE.md's table is made from.

Units and conventions:

- parameters: tied embedding counted once; ``params_offloaded`` is what lives on the slow tier: nothing (dense),
  every routed expert (MoE), the table's ``V x L x N x D`` entries (MoLE, as the seed counts it);
- ``params_fast``: what must sit in fast memory: all (dense), trunk + ``C`` experts per layer (MoE at capacity C),
  trunk incl. routers and shared experts (MoLE table form);
- bytes loaded per token: MoE experts counted at 2 bytes/parameter (fp16), MoLE as stored in the table (fp16 or
  NF4/int8 with their float16 block scales); ``device`` bytes are whole 4 KiB pages (flash/direct reads);
- perplexity: the first ``ppl_tokens`` of the held-out stream in non-overlapping 256-token windows
  (``train.loop.evaluate_nll``), the same tokens for every model; table models are scored through ``mmap`` reads;
- latency: CPU, ``threads`` torch threads, median decode step after a prefill of ``prompt_tokens`` held-out tokens
  (distinct windows per sequence, so batch 8 gets no free de-duplication of table reads).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from expertcache import __version__
from expertcache.jsonsafe import load_path

FP16 = 2


def heldout_stream(tokenizer_dir: str | Path, data_dir: str = "") -> np.ndarray:
    """The held-out split encoded with the tokenizer in ``tokenizer_dir`` (docs joined with eos)."""
    from expertcache.mole.modeling import register_auto
    from expertcache.train.data import encode_stream, load_documents, resolve_data_dir, split_documents
    from expertcache.train.tokenizer import load_tokenizer

    register_auto()  # a MoLE folder's config.json must be known to AutoTokenizer's config lookup
    tok = load_tokenizer(tokenizer_dir)
    _, heldout = split_documents(load_documents(resolve_data_dir(data_dir)))
    return encode_stream(tok, [d["text"] for d in heldout], tok.eos_token_id)


def flash_read_seconds(folder: Path, nbytes: int, reads: int = 64, seed: int = 0, file_mib: int = 64) -> float:
    """Median seconds of one ``pread`` of ``nbytes`` at a random offset of a fresh ``file_mib`` MiB scratch file in
    ``folder``, its pages dropped from the page cache before each read (what loading one expert from flash costs
    here). A scratch file, because pages that are memory-mapped (a loaded checkpoint) cannot be dropped."""
    path = folder / f".flash-probe-{os.getpid()}.bin"
    with open(path, "wb") as fh:
        fh.write(np.random.default_rng(seed).integers(0, 256, file_mib * 2**20, dtype=np.uint8).tobytes())
        fh.flush()
        os.fsync(fh.fileno())
    size = path.stat().st_size
    rng = np.random.default_rng(seed)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        times = []
        for off in rng.integers(0, max(1, size - nbytes), size=reads).tolist():
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            os.pread(fd, nbytes, off)
            times.append(time.perf_counter() - t0)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
        path.unlink()
    return float(np.median(times))


def moe_offloaded_latency(model_dir: Path, heldout_N: np.ndarray, batches, capacity: int, prompt_tokens: int,
                          new_tokens: int) -> dict:
    """Decode of the MoE through ``expertcache.offload`` (disk tier, ``io='fadvise'``: page cache dropped before
    every expert read, LRU, ``capacity`` slots per layer, experts read in the checkpoint's dtype)."""
    from expertcache.mole.bench import heldout_windows
    from expertcache.offload.runtime import OffloadConfig, OffloadedModel

    out = {"io": "fadvise", "capacity": capacity, "eviction": "lru"}
    for b in batches:
        rt = OffloadedModel.from_pretrained(model_dir, OffloadConfig(tier="disk", io="fadvise", capacity=capacity,
                                                                     batch=b), dtype=torch.float32)
        prompts = heldout_windows(heldout_N, b, prompt_tokens, seed=0)
        rt.generate(prompts, 4)  # warm-up (the cache starts from its state after it, like a running server)
        r = rt.generate(prompts, new_tokens)
        n, st = max(r["decode_tokens"], 1), r["decode_stats"]
        out[f"b{b}"] = {"decode_ms_per_step": 1e3 * r["decode_s"] / n, "io_ms_per_step": 1e3 * st["io_seconds"] / n,
                        "misses_per_token": st["misses"] / (n * b), "bytes_read_per_token": st["bytes_read"] / (n * b),
                        "hit_rate": st["hit_rate"], "expert_bytes": rt.expert_bytes}
    return out


def evaluate(model_dir: str | Path, data_dir: str = "", tokenizer_dir: str | Path | None = None,
             ppl_tokens: int = 131072, read_mode: str = "flash", batches=(1, 8), prompt_tokens: int = 64,
             new_tokens: int = 32, moe_tokens: int = 512, moe_capacity: int = 0, threads: int = 1, label: str = "",
             command: str = "") -> dict:
    from expertcache.mole import bench
    from expertcache.mole.table import TableSpec

    torch.set_num_threads(threads)
    model_dir = Path(model_dir)
    cfg = load_path(model_dir / "config.json")
    table = cfg.get("lookup_table")
    kind = {"llama": "dense", "mixtral": "moe", "expertcache_mole": "mole-table" if table else "mole"}.get(
        cfg.get("model_type"))
    if kind is None:
        raise ValueError(f"{model_dir}: model_type {cfg.get('model_type')!r} is not one of the compared kinds")
    heldout_N = heldout_stream(tokenizer_dir or model_dir, data_dir)
    row: dict = {"loadavg_at_start": os.getloadavg()[0], "label": label or model_dir.parent.name + ("" if model_dir.name == "model" else "/" + model_dir.name),
                 "model_dir": str(model_dir), "kind": kind, "command": command, "expertcache": __version__,
                 "torch": torch.__version__, "threads": threads, "cpu_count": os.cpu_count()}
    summary = model_dir / "train_summary.json"
    if not summary.exists() and table:
        summary = Path(table["source"]) / "train_summary.json"
    if summary.exists():
        s = load_path(summary)
        row["train"] = {"steps": s["steps_done"], "tokens_seen": s["tokens_seen"], "wall_s": s["train_wall_s"],
                        "command": s["command"], "spec": s.get("spec")}

    model = bench.load_any(model_dir, "mmap")
    row.update(bench.count_params(model))
    L, d = cfg["num_hidden_layers"], cfg["hidden_size"]
    if kind == "dense":
        row.update(params_offloaded=0, params_fast=row["params_total"], bytes_per_token={"b1": 0, "b8": 0})
    elif kind == "moe":
        k, f = cfg["num_experts_per_tok"], cfg["intermediate_size"]
        cap = moe_capacity or k  # equal fast memory with MoLE: the shared FFN's width = K experts of width ffn/K
        expert_params = 3 * d * f
        row.update(params_offloaded=row["params_routed_experts"],
                   params_fast=row["params_total"] - row["params_routed_experts"] + cap * L * expert_params,
                   moe_capacity=cap, expert_bytes_fp16=expert_params * FP16)
        loads = {f"b{b}": bench.moe_offload_loads(model, heldout_N, b, moe_tokens, cap, cfg["max_position_embeddings"])
                 for b in batches}
        row["moe_lru"] = loads
        row["bytes_per_token"] = {key: r["loads_per_token"] * expert_params * FP16 for key, r in loads.items()}
    elif kind == "mole-table":
        spec = TableSpec(**table)
        row.update(params_offloaded=spec.vocab * spec.layers * spec.m, params_fast=row["params_total"],
                   table=dict(quant=spec.quant, dtype=spec.dtype, record_bytes=spec.record_bytes,
                              table_bytes=spec.table_bytes,
                              table_bytes_fp16=spec.vocab * spec.layers * spec.m * FP16))
    else:  # training form: the experts are in memory; its table would hold V x L x N x D values
        row.update(params_offloaded=0, params_fast=row["params_total"],
                   table_params=cfg["vocab_size"] * L * cfg["num_experts"] * d)

    t0 = time.perf_counter()
    row.update(bench.perplexity(model, heldout_N, cfg["max_position_embeddings"], ppl_tokens))
    row["ppl_seconds"] = round(time.perf_counter() - t0, 1)

    if kind == "mole-table" and read_mode != "mmap":
        model = bench.load_any(model_dir, read_mode)
    latency = {}
    for b in batches:
        prompts = bench.heldout_windows(heldout_N, b, prompt_tokens, seed=0)
        latency[f"b{b}"] = bench.decode_latency(model, prompts, new_tokens, table=getattr(model.model, "table", None))
    row["latency"] = latency
    if kind == "mole-table":
        row["bytes_per_token"] = {key: r["table_bytes_per_position"] for key, r in latency.items()}
    if kind == "moe" and batches:
        row["offload_runtime"] = moe_offloaded_latency(model_dir, heldout_N, batches, row["moe_capacity"],
                                                       prompt_tokens, new_tokens)
        # cross-check of the runtime: in-memory decode + the step's LRU misses x one flash read each
        t_read = flash_read_seconds(model_dir.parent, row["expert_bytes_fp16"])
        row["flash_read_ms_per_expert"] = 1e3 * t_read
        row["offload_estimate_ms_per_step"] = {
            key: latency[key]["decode_ms_per_step"] + 1e3 * t_read * row["moe_lru"][key]["loads_per_token"] * b
            for key, b in ((f"b{b}", b) for b in batches)}
    return row

