"""Loading a Hugging Face MoE checkpoint (local folder or hub name) for expertcache."""

from __future__ import annotations

import os

import torch
from torch import nn

from expertcache.models.adapters import family_for

__all__ = ["load_model"]


def load_model(path_or_hub_name: str | os.PathLike, dtype: torch.dtype = torch.float32, **kwargs) -> nn.Module:
    """Load a supported MoE causal LM with ``AutoModelForCausalLM.from_pretrained`` in eval mode.

    A local folder is read without touching the network; any other string is a hub name (needs network
    access or the local hub cache). ``kwargs`` go to ``from_pretrained`` (e.g. ``device_map``,
    ``revision``). Raises ValueError listing the supported ``model_type`` values when the checkpoint is
    not one of them (checked from its config before the weights are read).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.fspath(path_or_hub_name)
    if os.path.isdir(path):
        kwargs.setdefault("local_files_only", True)
    config = AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items()
                                                 if k in ("local_files_only", "revision", "trust_remote_code")})
    family_for(config)  # fail before loading weights
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.eval()
    return model
