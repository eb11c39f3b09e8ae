"""Figures of the MoLE report: held-out perplexity, decode latency, parameters and bytes loaded per token.

Decoding is split gpt-fast style into :func:`prefill`, :func:`decode_one_token` and :func:`decode_n_tokens` (each a
natural timing boundary); they work for any causal LM taking ``input_ids``/``past_key_values`` (Llama, Mixtral,
MoLE in either form). Greedy decoding.

MoE offloading at equal fast memory (:func:`moe_offload_loads`): the MoLE model keeps its trunk (with the shared
expert, width ``ffn``) in fast memory, so the MoE gets the same fast memory for experts, i.e. ``C = ffn / expert
width = K`` experts per layer. Routing is replayed from the MoE's own selections on held-out text through one LRU
cache per layer; a step at batch B needs the union of the B tokens' experts (a miss is an expert not resident at
the start of the step; ``expertcache.cache`` step rule). Bytes loaded per token = misses x expert bytes / tokens.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import torch

from expertcache.jsonsafe import load_path
from expertcache.models.cachearg import cache_kw, out_cache


@torch.no_grad()
def prefill(model, ids_BT: torch.Tensor):
    """Run the prompt; returns (logits of the last position ``[B, V]``, KV cache)."""
    out = model(input_ids=ids_BT, use_cache=True)
    return out.logits[:, -1], out_cache(out)


@torch.no_grad()
def decode_one_token(model, ids_B1: torch.Tensor, cache):
    out = model(input_ids=ids_B1, **cache_kw(cache), use_cache=True)
    return out.logits[:, -1], out_cache(out)


@torch.no_grad()
def decode_n_tokens(model, logits_BV: torch.Tensor, cache, n: int, on_token=None) -> tuple[torch.Tensor, list[float]]:
    """Greedy-decode ``n`` tokens from the prefill's last logits; returns (tokens ``[B, n]``, seconds per step).
    ``on_token(step, next_B)`` is called as each token is chosen (streaming)."""
    toks, times = [], []
    for i in range(n):
        next_B = logits_BV.argmax(-1)
        toks.append(next_B)
        if on_token is not None:
            on_token(i, next_B)
        if i == n - 1:
            break
        t0 = time.perf_counter()
        logits_BV, cache = decode_one_token(model, next_B[:, None], cache)
        times.append(time.perf_counter() - t0)
    return torch.stack(toks, dim=1), times


def decode_latency(model, prompts_BT: torch.Tensor, new_tokens: int = 32, repeats: int = 2, table=None) -> dict:
    """Median seconds per decode step (batch B = ``len(prompts_BT)``) over ``repeats`` runs of ``new_tokens``, and
    the prefill time; the first run is also a warm-up. With ``table`` (a MoLE model's
    :class:`~expertcache.mole.table.LookupTable`) the table reads of the decode steps (not the prefill) are added."""
    steps, prefills = [], []
    reads = {"positions": 0, "reads": 0, "bytes": 0, "device_bytes": 0, "seconds": 0.0, "lookups": 0}
    for _ in range(repeats):
        t0 = time.perf_counter()
        logits, cache = prefill(model, prompts_BT)
        prefills.append(time.perf_counter() - t0)
        if table is not None:
            table.reset_stats()
        _, times = decode_n_tokens(model, logits, cache, new_tokens)
        steps.extend(times)
        if table is not None:
            s = table.reset_stats()
            for key, v in (("positions", s.tokens), ("reads", s.reads), ("bytes", s.bytes),
                           ("device_bytes", s.device_bytes), ("seconds", s.seconds), ("lookups", s.lookups)):
                reads[key] += v
    row = {"batch": int(len(prompts_BT)), "prompt_tokens": int(prompts_BT.shape[1]), "new_tokens": new_tokens,
           "decode_ms_per_step": 1e3 * float(np.median(steps)), "decode_ms_p90": 1e3 * float(np.percentile(steps, 90)),
           "prefill_ms": 1e3 * float(np.median(prefills))}
    if table is not None:
        n = max(reads["positions"], 1)
        row.update(read_mode=table.read_mode, table_reads=reads["reads"], table_positions=reads["positions"],
                   table_bytes_per_position=reads["bytes"] / n, device_bytes_per_position=reads["device_bytes"] / n,
                   read_ms_per_step=1e3 * reads["seconds"] / max(reads["lookups"], 1))
    return row


def heldout_windows(heldout_N: np.ndarray, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """``batch`` distinct held-out windows of ``length`` tokens ``[B, length]`` (fixed seed: same for every model)."""
    rng = np.random.default_rng(seed)
    starts = rng.choice(len(heldout_N) - length, size=batch, replace=False)
    return torch.from_numpy(np.stack([heldout_N[s : s + length] for s in starts]).astype(np.int64))


@torch.no_grad()
def moe_selections(model, chunks_CT: torch.Tensor, batch_size: int = 8) -> np.ndarray:
    """Top-K expert ids ``[C, T, L, K]`` (descending router weight) of a transformers MoE model on ``chunks``."""
    k = model.config.num_experts_per_tok
    out = []
    for i in range(0, len(chunks_CT), batch_size):
        x = chunks_CT[i : i + batch_size]
        r = model(input_ids=x, output_router_logits=True, use_cache=False).router_logits  # L x [B*T, E]
        ids = torch.stack([torch.topk(z.float(), k, dim=-1).indices for z in r], dim=1)  # [B*T, L, K]
        out.append(ids.view(len(x), x.shape[1], len(r), k).numpy())
    return np.concatenate(out)


def lru_batched_misses(ids_BTLK: np.ndarray, num_experts: int, capacity: int) -> np.ndarray:
    """Misses per layer ``[L]`` when the B sequences are decoded together, one step per position: a step requests
    the union of its B tokens' experts (in row order) from one LRU cache per layer
    (:func:`expertcache.cache.make_cache`: the step rule of the simulator and of the offloaded runtime's shared
    cache). With B = 1 this is ``expertcache.sim.replay`` with ``eviction='lru'``."""
    from expertcache.cache import make_cache

    b, t, L, k = ids_BTLK.shape
    misses = np.zeros(L, dtype=np.int64)
    for layer in range(L):
        cache = make_cache("lru", num_experts, capacity)
        cache.serve(list(dict.fromkeys(ids_BTLK[:, step, layer, :].reshape(-1).tolist())) for step in range(t))
        misses[layer] = cache.stats.misses
    return misses


def moe_offload_loads(model, heldout_N: np.ndarray, batch: int, tokens: int, capacity: int, seq_len: int) -> dict:
    """LRU expert loads of ``model`` at ``capacity`` experts per layer when decoding ``batch`` held-out sequences
    together (``tokens`` positions each, cache carried across the whole run)."""
    windows = heldout_windows(heldout_N, batch, tokens, seed=1)
    chunks = windows.view(batch, -1, min(seq_len, tokens)).reshape(-1, min(seq_len, tokens))
    ids = moe_selections(model, chunks).reshape(batch, tokens, model.config.num_hidden_layers, -1)
    e = model.config.num_local_experts
    misses_L = lru_batched_misses(ids, e, capacity)
    d, f = model.config.hidden_size, model.config.intermediate_size
    return {"batch": batch, "tokens_per_sequence": tokens, "capacity": capacity, "num_experts": e,
            "top_k": int(ids.shape[-1]), "misses_per_layer": misses_L.tolist(),
            "loads_per_token": float(misses_L.sum() / (batch * tokens)),
            "expert_params": 3 * d * f, "miss_rate": float(misses_L.sum() / (batch * tokens * len(misses_L) * ids.shape[-1]))}


def count_params(model) -> dict:
    """Parameters: total (tied embedding once), routed experts, and per-token active at inference."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n or ".expert_norm." in n)
    return {"params_total": int(total), "params_routed_experts": int(experts)}


def perplexity(model, heldout_N: np.ndarray, seq_len: int, max_tokens: int) -> dict:
    from expertcache.train.loop import evaluate_nll

    nll, n = evaluate_nll(model, heldout_N, seq_len, max_tokens, batch_size=8)
    return {"heldout_nll": nll, "heldout_ppl": math.exp(nll), "heldout_tokens_scored": n}


def load_any(model_dir: str | Path, read_mode: str = "mmap"):
    """A compared model from its folder: training-form (dense/moe/mole) or an exported MoLE table."""
    from transformers import AutoModelForCausalLM

    from expertcache.mole.modeling import load_table_model  # importing it registers MoLE with the Auto classes

    cfg = load_path(Path(model_dir) / "config.json")
    if cfg.get("lookup_table"):
        return load_table_model(model_dir, read_mode)
    kw = {"experts_implementation": "grouped_mm"} if cfg.get("model_type") == "mixtral" else {}
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kw).eval()
