"""Tiny random models of every supported MoE family (the "debug" configs used by the tests).

``tiny_config(arch)`` returns a small ``PretrainedConfig`` (2-3 layers, hidden 32, 8-16 experts, top-2..4,
vocab 128); ``save_tiny(arch, path, seed)`` builds a random model from it and writes it with
``save_pretrained`` so tests load it back through :func:`expertcache.models.load_model`, the same path a
real checkpoint takes.

Router weights are re-drawn with std 1/sqrt(D) (instead of the 0.02 init) so that routing is decisive
enough for policies to matter; DeepSeek-V3's ``e_score_correction_bias`` and GPT-OSS's router bias are
non-zero random values.

Archs: the model types in ``SUPPORTED_MODEL_TYPES`` plus ``deepseek_v2_grouped`` (DeepSeek-V2 with
``group_limited_greedy``, the full-size V2 routing).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["TINY_ARCHS", "tiny_config", "build_tiny", "save_tiny"]

_COMMON = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)

_DEEPSEEK = dict(intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3, first_k_dense_replace=1,
                 n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=8, head_dim=8, num_key_value_heads=4)

_ARCH_KW: dict[str, tuple[str, dict]] = {
    "olmoe": ("olmoe", dict(intermediate_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=False)),
    "mixtral": ("mixtral", dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=8,
                                num_experts_per_tok=2, head_dim=8, sliding_window=None)),
    "qwen2_moe": ("qwen2_moe", dict(intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                    num_hidden_layers=2, num_experts=8, num_experts_per_tok=4, norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe", dict(intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                                    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=8)),
    "deepseek_v2": ("deepseek_v2", dict(_DEEPSEEK, n_routed_experts=8, num_experts_per_tok=3, topk_method="greedy",
                                        routed_scaling_factor=1.0)),
    "deepseek_v2_grouped": ("deepseek_v2", dict(_DEEPSEEK, n_routed_experts=16, num_experts_per_tok=3,
                                                topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                                routed_scaling_factor=16.0)),
    "deepseek_v3": ("deepseek_v3", dict(_DEEPSEEK, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    "phimoe": ("phimoe", dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                              router_jitter_noise=0.01, input_jitter_noise=0.0, head_dim=8, sliding_window=None)),
    "gpt_oss": ("gpt_oss", dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=4,
                                head_dim=8, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}

TINY_ARCHS = tuple(_ARCH_KW)


def tiny_config(arch: str):
    """A tiny ``PretrainedConfig`` of ``arch`` (one of ``TINY_ARCHS``)."""
    from transformers import AutoConfig

    if arch not in _ARCH_KW:
        raise ValueError(f"no tiny config for {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    model_type, kw = _ARCH_KW[arch]
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **kw})
    return cfg


def build_tiny(arch: str, seed: int = 0):
    """A random tiny model of ``arch`` (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    from expertcache.models.adapters import family_for, find_moe_layers

    cfg = tiny_config(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    family = family_for(model)
    with torch.no_grad():
        for m in find_moe_layers(model, family):
            r = m.router
            r.weight.copy_(torch.randn(r.weight.shape, generator=g) / cfg.hidden_size ** 0.5)
            if hasattr(r, "e_score_correction_bias"):
                r.e_score_correction_bias.copy_(0.1 * torch.randn(r.num_experts, generator=g))
            if getattr(r, "bias", None) is not None:
                r.bias.copy_(0.5 * torch.randn(r.num_experts, generator=g))
    model.eval()
    return model


def save_tiny(arch: str, path: str | os.PathLike, seed: int = 0) -> Path:
    """Build a random tiny ``arch`` model and ``save_pretrained`` it to ``path``; returns the path."""
    path = Path(path)
    build_tiny(arch, seed).save_pretrained(path)
    return path
