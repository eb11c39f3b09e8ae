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
from expertcache.outputs import check_folder_output, mark_folder

MAKE_MODEL_COMMAND = "bench --make-model"  # the writer named in the folders it writes

__all__ = ["BENCH_MODELS", "make_bench_model", "bench_models_dir"]

# published configurations (hub config.json of allenai/OLMoE-1B-7B-0924, Qwen/Qwen1.5-MoE-A2.7B,
# deepseek-ai/DeepSeek-V2-Lite, Qwen/Qwen3-30B-A3B and openai/gpt-oss-20b; rope scaling (yarn) left out: it
# changes no tensor shape; gpt-oss experts written in bf16, not MXFP4)
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
    "deepseek-v2-lite": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                             moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
                             first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, head_dim=64, topk_method="greedy", n_group=1,
                             topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                             max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
                             bos_token_id=100000, eos_token_id=100001,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
                          max_position_embeddings=40960, tie_word_embeddings=False, bos_token_id=151643,
                          eos_token_id=151645, use_sliding_window=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "gpt-oss-20b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128, swiglu_limit=7.0,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                        attention_bias=True, eos_token_id=200002, pad_token_id=199999,
                        rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
}


def bench_models_dir() -> Path:
    from expertcache.offload.loader import cache_dir

    return cache_dir() / "bench-models"


def _disk_entries(model_type: str, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """transformers' in-memory tensor ``name`` → the keys it writes to disk for the family (its ``DiskLayout``):
    fused expert tensors split per expert where the family stores them so, other tensors renamed (GPT-OSS keeps
    its fused tensors)."""
    from expertcache.models.adapters import FAMILIES

    layout = FAMILIES[model_type].disk
    if layout.expert_parts is not None:
        for fused, slots in (("gate_up_proj", (0, 1)), ("down_proj", (2,))):  # [E, 2F, D] gate|up; [E, D, F]
            if name.endswith("mlp.experts." + fused):
                layer_id = int(name.split(".")[2])  # model.layers.{i}.mlp.experts...
                e, rows, cols = shape
                return [(layout.expert_keys(layer_id, i)[s], (rows // len(slots), cols))
                        for i in range(e) for s in slots]
    return [(layout.disk_keys(name)[-1], shape)]


def _layer_types(kw: dict) -> None:
    """GPT-OSS alternates sliding-window and full attention; the list must match the layer count."""
    if kw.get("sliding_window") and "layer_types" not in kw and kw.get("num_hidden_layers"):
        kw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(kw["num_hidden_layers"])]


_TOKENIZER_TEXT = ("The Debian package manager installs, upgrades and removes software; the configuration files of "
                   "a package are kept in /etc and its documentation in /usr/share/doc. apt-get update reads the "
                   "package lists; dpkg -i installs a local file. 0123456789 ()[]{}<>=+-*/%&|^~!?.,:;'\"_#@$\n")


def write_bench_tokenizer(folder: Path, max_length: int) -> None:
    """A small byte-level BPE ``tokenizer.json`` (any text encodes; ids below the model's vocabulary), so that
    tools that insist on a tokenizer (generate, peers' converters) accept the folder. Deterministic."""
    from expertcache.train.tokenizer import train_tokenizer

    train_tokenizer([_TOKENIZER_TEXT] * 4, 384, folder, model_max_length=max_length)


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
                     quant: str | None = None, group: int = 64, dtype: torch.dtype = torch.bfloat16,
                     overrides: dict | None = None) -> Path:
    """Write (or reuse) the random-weight checkpoint ``name`` with ``layers`` decoder layers (default: the
    published count) into ``out`` (default ``~/.cache/expertcache/bench-models/<name>-L<layers>``); with
    ``quant`` also its quantised expert sidecar. Returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in BENCH_MODELS:
        raise ValueError(f"unknown benchmark model {name!r}; choose one of {', '.join(BENCH_MODELS)}")
    kw = dict(BENCH_MODELS[name], **(overrides or {}))  # overrides: shrunk shapes for tests
    model_type = kw.pop("model_type")
    if layers is not None:
        if not 1 <= layers <= kw["num_hidden_layers"]:
            raise ValueError(f"{name} has {kw['num_hidden_layers']} layers; --layers must be in [1, that]")
        kw["num_hidden_layers"] = layers
    _layer_types(kw)
    n_layers = kw["num_hidden_layers"]
    folder = Path(out) if out is not None else bench_models_dir() / f"{name}-L{n_layers}-e1"
    if out is not None:  # its config.json is rewritten: never a folder of the user's (expertcache.outputs)
        check_folder_output(folder, "--out-dir", MAKE_MODEL_COMMAND)
    config = AutoConfig.for_model(model_type, **kw)
    config.dtype = dtype
    done = folder / "model.safetensors"
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=dtype)
    config.architectures = [type(meta).__name__]
    folder.mkdir(parents=True, exist_ok=True)
    mark_folder(folder, MAKE_MODEL_COMMAND)
    if not (folder / "tokenizer.json").is_file():
        write_bench_tokenizer(folder, int(kw.get("max_position_embeddings", 4096)))
    config.save_pretrained(folder)
    if not done.is_file():
        entries = []
        for pname, t in meta.state_dict().items():
            if pname == "lm_head.weight" and config.tie_word_embeddings:
                continue
            entries += _disk_entries(model_type, pname, tuple(t.shape))
        std = getattr(config, "initializer_range", 0.02)
        write_safetensors(done, [(k, dtype, s, _maker(k, s, dtype, std)) for k, s in sorted(entries)],
                          {"format": "pt", "expertcache": f"random-weights {name}"})
        (folder / "BENCH_MODEL.md").write_text(
            f"# {name} (random weights, {n_layers} layers)\n\nWritten by `expertcache bench --make-model {name}`: "
            "the published shapes with random N(0, 0.02) weights (token embeddings N(0, 1)). Random weights route almost uniformly; use it "
            "for bytes and tokens per second only, never for quality.\n")
        (folder / "expertcache.json").write_text(json.dumps(dict(name=name, layers=n_layers, dtype=str(dtype))))
    if quant:
        from expertcache.models.adapters import family_for, find_moe_layers
        from expertcache.offload.checkpoint import Checkpoint
        from expertcache.offload.store import quantize_checkpoint

        moe = find_moe_layers(meta, family_for(config))
        quantize_checkpoint(Checkpoint(folder, family_for(config).disk, moe[0].num_experts), [m.layer_id for m in moe],
                            quant, group)
    return folder
