"""Re-parameterise a training-form MoLE model into its table form (``expertcache mole export``): every routed
expert's output for every vocabulary token, written as the lookup table that :mod:`expertcache.mole.table`
reads. Depends on the model (:mod:`~expertcache.mole.modeling`) and the table format, which do not depend
on each other's export."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from expertcache.jsonsafe import load_path
from expertcache.mole import quant as Q
from expertcache.mole.modeling import MoleForCausalLM
from expertcache.mole.table import TableSpec
from expertcache.outputs import check_folder_output, check_not_input, publish_folder, temp_folder

__all__ = ["compute_lut", "export_table"]


@torch.no_grad()
def compute_lut(model, ids_U: torch.Tensor) -> torch.Tensor:
    """``LUT[v, l, j] = FFN_j(RMSNorm_e(Embedding(v)))`` of a training-form MoLE model: ``[U, L, N, D]`` float32."""
    core = model.model
    e_UD = core.embed_tokens(ids_U)
    return torch.stack([layer.mlp.routed_outputs(e_UD) for layer in core.layers], dim=1).float()


def export_table(model_dir: str | Path, out: str | Path, quant: str = "none", dtype: str = "float16",
                 chunk: int = 1024, threads: int = 1) -> Path:
    """Re-parameterise the training-form MoLE model in ``model_dir`` into the table folder ``out`` (see the module
    docstring); returns ``out``. Routed expert outputs are computed in float32 from the saved weights."""


    if quant not in Q.QUANTS:
        raise ValueError(f"unknown quant {quant!r}; choose one of {Q.QUANTS}")
    if dtype not in ("float32", "float16"):
        raise ValueError(f"dtype must be float32 or float16, not {dtype!r}")
    torch.set_num_threads(threads)
    model_dir, out = Path(model_dir), Path(out)
    check_not_input(out, "out", {f"model {model_dir}": model_dir}, replaces_folder=True)
    check_folder_output(out, "out", "mole export")  # before any work
    cfg_json = load_path(model_dir / "config.json") if (model_dir / "config.json").exists() else {}
    if cfg_json.get("model_type") != "expertcache_mole" or cfg_json.get("lookup_table") is not None:
        raise ValueError(f"{model_dir} is not a training-form MoLE model folder (config.json model_type "
                         f"{cfg_json.get('model_type')!r})")
    model = MoleForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cfg = model.config
    spec = TableSpec(vocab=cfg.vocab_size, layers=cfg.num_hidden_layers, experts=cfg.num_experts,
                     hidden=cfg.hidden_size, quant=quant, dtype=dtype if quant == "none" else "float16",
                     source=str(model_dir))
    tmp = temp_folder(out)
    try:
        return _write_table(model, model_dir, out, tmp, spec, chunk)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_table(model, model_dir: Path, out: Path, tmp: Path, spec: TableSpec, chunk: int) -> Path:
    from safetensors.torch import save_file

    cfg = model.config
    lut = np.lib.format.open_memmap(tmp / spec.file, mode="w+", dtype=np.uint8, shape=(spec.vocab, spec.record_bytes))
    for a in range(0, spec.vocab, chunk):
        ids = torch.arange(a, min(a + chunk, spec.vocab))
        lut[a : a + len(ids)] = spec.encode(compute_lut(model, ids).reshape(len(ids), spec.layers, spec.m).numpy())
    lut.flush()
    del lut
    with open(tmp / spec.file, "rb+") as fh:
        os.fsync(fh.fileno())

    trunk = {k: v.contiguous() for k, v in model.state_dict().items()
             if ".mlp.experts." not in k and ".mlp.expert_norm." not in k and k != "lm_head.weight"}
    save_file(trunk, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg.lookup_table = asdict(spec)
    cfg.architectures = ["MoleForCausalLM"]
    cfg.save_pretrained(tmp)
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "generation_config.json":
            shutil.copy(f, tmp / f.name)
    (tmp / "export_summary.json").write_text(json.dumps({
        "source": str(model_dir), "table": asdict(spec), "record_bytes": spec.record_bytes,
        "table_bytes": spec.table_bytes, "trunk_params": int(sum(v.numel() for v in trunk.values())),
    }, indent=2) + "\n")
    return publish_folder(tmp, out, "mole export")
