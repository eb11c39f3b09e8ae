"""Random-weight checkpoints at the published shapes of real MoE models, for throughput benchmarks.

``make_bench_model('olmoe-1b-7b', layers=4)`` writes a transformers checkpoint folder (config.json +
model.safetensors, bf16, per-expert keys as transformers 5.x ``save_pretrained`` writes them) whose every
tensor has the shape of the published model (config numbers below, from the models' config.json on the
Hugging Face hub), optionally with fewer decoder layers to fit disk and time. Tensors are generated and
written one at a time (never the whole model in memory).

**Random weights route almost uniformly**: the router logits of a random model carry no token structure, so
expert popularity is flat and temporal locality is that of independent draws. This needs the token
embeddings at std 1 (every other matrix N(0, 0.02), norms 1): with 0.02 everywhere the attention output, an
average over the whole context, dominates each hidden state and decode steps route almost identically
(measured: 91 % LRU hit rate at C = N/2 on OLMoE shapes) -- a best case for any cache, not a benchmark. These checkpoints measure
bytes moved and tokens per second at real expert sizes; routing quality, hit rates of trained routers and
perplexity come from the trained default models (``granular``, ``coarse``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from expertcache.offload.writer import write_safetensors

__all__ = ["BENCH_MODELS", "make_bench_model", "bench_models_dir"]

# published configurations (hub config.json of allenai/OLMoE-1B-7B-0924 and Qwen/Qwen1.5-MoE-A2.7B)
BENCH_MODELS: dict[str, dict] = {
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                        vocab_size=50304, max_position_embeddings=4096, norm_topk_prob=False,
                        tie_word_embeddings=False, rms_norm_eps=1e-5, clip_qkv=None, pad_token_id=1,
                        eos_token_id=50279, bos_token_id=None,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen1.5-moe-a2.7b": dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632,
                              moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                              num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, num_experts=60,
                              num_experts_per_tok=4, vocab_size=151936, max_position_embeddings=8192,
                              norm_topk_prob=False, tie_word_embeddings=False, rms_norm_eps=1e-6,
                              decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                              bos_token_id=151643, eos_token_id=151643,
                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


def bench_models_dir() -> Path:
    return Path(os.environ.get("EXPERTCACHE_CACHE", Path.home() / ".cache" / "expertcache")) / "bench-models"


def _disk_entries(model_type: str, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """transformers' in-memory fused expert tensors → the per-expert keys it writes to disk."""
    if name.endswith("mlp.experts.gate_up_proj"):
        prefix = name[: -len("gate_up_proj")]
        if model_type == "mixtral":
            prefix = prefix.replace(".mlp.", ".block_sparse_moe.")
        e, f2, d = shape
        names = ("w1", "w3") if model_type == "mixtral" else ("gate_proj", "up_proj")
        return [(f"{prefix}{i}.{n}.weight", (f2 // 2, d)) for i in range(e) for n in names]
    if name.endswith("mlp.experts.down_proj"):
        prefix = name[: -len("down_proj")]
        if model_type == "mixtral":
            prefix = prefix.replace(".mlp.", ".block_sparse_moe.")
        e, d, f = shape
        n = "w2" if model_type == "mixtral" else "down_proj"
        return [(f"{prefix}{i}.{n}.weight", (d, f)) for i in range(e)]
    if model_type == "mixtral":
        name = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
    return [(name, shape)]


def _maker(key: str, shape: tuple[int, ...], dtype: torch.dtype, std: float):
    def make() -> torch.Tensor:
        if key.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype)
        if key.endswith(".bias"):
            return torch.zeros(shape, dtype=dtype)
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & (2**63 - 1)
        g = torch.Generator().manual_seed(seed)
        scale = 1.0 if key.endswith("embed_tokens.weight") else std
        return (torch.randn(shape, generator=g) * scale).to(dtype)
    return make


def make_bench_model(name: str, *, layers: int | None = None, out: str | os.PathLike | None = None,
                     quant: str | None = None, group: int = 64, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write (or reuse) the random-weight checkpoint ``name`` with ``layers`` decoder layers (default: the
    published count) into ``out`` (default ``~/.cache/expertcache/bench-models/<name>-L<layers>``); with
    ``quant`` also its quantised expert sidecar. Returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in BENCH_MODELS:
        raise ValueError(f"unknown benchmark model {name!r}; choose one of {', '.join(BENCH_MODELS)}")
    kw = dict(BENCH_MODELS[name])
    model_type = kw.pop("model_type")
    if layers is not None:
        if not 1 <= layers <= kw["num_hidden_layers"]:
            raise ValueError(f"{name} has {kw['num_hidden_layers']} layers; --layers must be in [1, that]")
        kw["num_hidden_layers"] = layers
    n_layers = kw["num_hidden_layers"]
    folder = Path(out) if out is not None else bench_models_dir() / f"{name}-L{n_layers}-e1"
    config = AutoConfig.for_model(model_type, **kw)
    config.dtype = dtype
    done = folder / "model.safetensors"
    if not done.is_file():
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, dtype=dtype)
        entries = []
        for pname, t in meta.state_dict().items():
            if pname == "lm_head.weight" and config.tie_word_embeddings:
                continue
            entries += _disk_entries(model_type, pname, tuple(t.shape))
        std = getattr(config, "initializer_range", 0.02)
        folder.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(folder)
        write_safetensors(done, [(k, dtype, s, _maker(k, s, dtype, std)) for k, s in sorted(entries)],
                          {"format": "pt", "expertcache": f"random-weights {name}"})
        (folder / "BENCH_MODEL.md").write_text(
            f"# {name} (random weights, {n_layers} layers)\n\nWritten by `expertcache bench --make-model {name}`: "
            "the published shapes with random N(0, 0.02) weights (token embeddings N(0, 1)). Random weights route almost uniformly; use it "
            "for bytes and tokens per second only, never for quality.\n")
        (folder / "expertcache.json").write_text(json.dumps(dict(name=name, layers=n_layers, dtype=str(dtype))))
    if quant:
        from expertcache.models.adapters import family_for
        from expertcache.offload.checkpoint import Checkpoint
        from expertcache.offload.store import quantize_checkpoint

        ckpt = Checkpoint(folder, model_type, config.num_experts)
        family_for(config)
        moe_ids = [i for i in range(n_layers)]
        quantize_checkpoint(ckpt, moe_ids, quant, group)
    return folder
