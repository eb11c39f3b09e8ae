"""Loading a Hugging Face MoE checkpoint (local folder or hub name) for expertcache."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from torch import nn

from expertcache.models.adapters import family_for

__all__ = ["load_model", "is_hub_name", "fetch_hub_model", "HUB_FILES"]

# What a hub download fetches: configs, safetensors weights and tokenizer files -- never pickled weights
# (``*.bin``, ``*.pt``), never remote code (``*.py``).
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_hub_name(name: str | os.PathLike) -> bool:
    """True when ``name`` is not an existing path and reads as a Hugging Face hub id ``owner/name``."""
    text = os.fspath(name)
    return not os.path.exists(os.path.expanduser(text)) and bool(_HUB_NAME.fullmatch(text)) and ".." not in text


def fetch_hub_model(name: str, revision: str | None = None) -> Path:
    """Local folder of hub model ``name`` (``owner/name``): the hub cache's copy, downloaded first if needed
    (configs, safetensors and tokenizer files only, see ``HUB_FILES``). FileNotFoundError in one line when the
    model is not local and cannot be downloaded (offline, ``HF_HUB_OFFLINE=1``, unknown or gated repository)."""
    from huggingface_hub import constants, errors, snapshot_download

    try:
        folder = snapshot_download(name, revision=revision, allow_patterns=HUB_FILES)
    except Exception as exc:  # offline, HTTP, auth, not-found: all mean "cannot get it"
        if isinstance(exc, (errors.RepositoryNotFoundError, errors.RevisionNotFoundError)):
            why = "the hub has no such repository or revision (or it is private / gated)"
        elif constants.HF_HUB_OFFLINE:
            why = "the hub is unreachable: HF_HUB_OFFLINE is set"
        else:
            first = str(exc).strip().split(". ")[0].splitlines()[0][:160] if str(exc).strip() else ""
            why = f"the hub is unreachable ({type(exc).__name__}{': ' + first if first else ''})"
        raise FileNotFoundError(f"model {name!r} is not a local folder nor in the local hub cache, and {why}; "
                                f"give a local checkpoint folder, 'granular' or 'coarse'") from None
    folder = Path(folder)
    if not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"hub model {name!r} has no safetensors weights (pickled weights are not loaded)")
    return folder


def load_model(path_or_hub_name: str | os.PathLike, dtype: torch.dtype = torch.float32, **kwargs) -> nn.Module:
    """Load a supported MoE causal LM with ``AutoModelForCausalLM.from_pretrained`` in eval mode.

    A local folder is read without touching the network; a hub name ``owner/name`` is fetched with
    :func:`fetch_hub_model` (needs network access or the local hub cache; configs, safetensors and tokenizer
    files only) and then read from its local copy. ``kwargs`` go to ``from_pretrained`` (e.g. ``device_map``,
    ``revision``). Raises ValueError listing the supported ``model_type`` values when the checkpoint is
    not one of them (checked from its config before the weights are read).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.fspath(path_or_hub_name)
    if is_hub_name(path):
        path = os.fspath(fetch_hub_model(path, kwargs.pop("revision", None)))
    if os.path.isdir(path):
        kwargs.setdefault("local_files_only", True)
    config = AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items()
                                                 if k in ("local_files_only", "revision", "trust_remote_code")})
    family_for(config)  # fail before loading weights
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.eval()
    return model
