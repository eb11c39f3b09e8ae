"""Tiny random models of every supported MoE family (the "debug" configs used by the tests).

``tiny_config(arch)`` returns a small ``PretrainedConfig`` (2-3 layers, hidden 32, 8-16 experts, top-2..4,
vocab 128); ``save_tiny(arch, path, seed)`` builds a random model from it and writes it with
``save_pretrained`` so tests load it back through :func:`expertcache.models.load_model`, the same path a
real checkpoint takes.

Router weights are re-drawn with std 1/sqrt(D) (instead of the 0.02 init) so that routing is decisive
enough for policies to matter; DeepSeek-V3's ``e_score_correction_bias`` and GPT-OSS's router bias are
non-zero random values.

Archs: the configs each family declares in its ``Family.tiny`` (:mod:`expertcache.models.adapters`): one
named after every model type in ``SUPPORTED_MODEL_TYPES``, plus variants such as ``deepseek_v2_grouped``
(DeepSeek-V2 with ``group_limited_greedy``, the full-size V2 routing).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from expertcache.models.adapters import FAMILIES

__all__ = ["TINY_ARCHS", "tiny_config", "build_tiny", "save_tiny"]

_COMMON = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)



def _arch_kw() -> dict[str, tuple[str, dict]]:
    """arch → (model_type, its fields over ``_COMMON``): every registered family's ``Family.tiny`` configs, in
    registry order (read when used, so a family registered later has its tiny model too)."""
    return {arch: (f.model_type, kw) for f in FAMILIES.values() for arch, kw in f.tiny.items()}


#: the tiny configs of the shipped families (the tests' parametrisation)
TINY_ARCHS = tuple(_arch_kw())


def tiny_config(arch: str):
    """A tiny ``PretrainedConfig`` of ``arch`` (a name of some family's ``Family.tiny``, e.g. ``TINY_ARCHS``)."""
    from transformers import AutoConfig

    archs = _arch_kw()
    if arch not in archs:
        raise ValueError(f"no tiny config for {arch!r}; choose one of {', '.join(archs)}")
    model_type, kw = archs[arch]
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
