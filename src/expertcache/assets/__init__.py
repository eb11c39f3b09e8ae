"""Files shipped inside the package: the two small trained MoE language models.

``models/granular`` (OLMoE, 32 experts, top-8) and ``models/coarse`` (Mixtral, 8 experts, top-2) are Hugging Face
checkpoint folders (bf16 weights, tokenizer, MODEL_CARD.md), loadable offline with
``AutoModelForCausalLM.from_pretrained(shipped_model_dir(name))``. They are produced by ``expertcache train``.
"""

from __future__ import annotations

import pathlib

SHIPPED_MODELS = ("granular", "coarse")
MODELS_DIR = pathlib.Path(__file__).resolve().parent / "models"


def shipped_model_dir(name: str = "granular") -> pathlib.Path:
    """Folder of the shipped model ``name`` (one of :data:`SHIPPED_MODELS`).

    Raises ValueError for an unknown name and FileNotFoundError if the model's files are not installed.
    """
    if name not in SHIPPED_MODELS:
        raise ValueError(f"unknown shipped model {name!r}; available: {', '.join(SHIPPED_MODELS)}")
    path = MODELS_DIR / name
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"shipped model {name!r} is incomplete: {path} lacks {', '.join(missing)}. Reinstall expertcache, or "
            f"re-create it with `expertcache train --model {name} --ship`."
        )
    return path
