"""Loading everything but the experts: the non-expert weights of an offloaded model, read by key from the
checkpoint into a skeleton built on the ``meta`` device, and the rotary tables (non-persistent buffers,
recomputed). Loud: a missing tensor, a shape mismatch or an unexpected non-expert key raises
:class:`~expertcache.offload.checkpoint.CheckpointError`."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from expertcache.offload.budget import release_free_heap
from expertcache.offload.checkpoint import Checkpoint, CheckpointError
from expertcache.offload.densecache import load_or_pack_dense
from expertcache.offload.diskembed import DiskEmbedding, use_disk_embedding  # noqa: F401 - the runtime's, from here
from expertcache.outputs import env_path

__all__ = ["cache_dir", "load_non_expert", "recompute_rotary"]


def cache_dir() -> Path:
    """expertcache's cache folder (``$EXPERTCACHE_CACHE``, default ``~/.cache/expertcache``; an empty variable is
    unset, not the current folder)."""
    return env_path("EXPERTCACHE_CACHE") or Path.home() / ".cache" / "expertcache"


def load_non_expert(model: nn.Module, ckpt: Checkpoint, config, packed: dict[str, nn.Module] | None = None, *,
                    dense_cache: str | os.PathLike | None = None, stats: dict | None = None) -> None:
    """Read every non-expert parameter and persistent buffer of ``model`` from the checkpoint by key (tried as
    named, then as the family renames it on disk: ``ckpt.layout.disk_keys``; tied weights once). Missing keys,
    shape mismatches and unexpected non-expert keys raise.

    ``packed``: {weight name: module with ``load_rows``} of the weights quantised while loading
    (:func:`expertcache.offload.qlinear.quantize_dense_skeleton`): each is read from the checkpoint a block of
    rows at a time and packed, never held whole (a tied ``lm_head.weight`` is read from the embedding's key).
    ``dense_cache``: a folder where the packed weights are cached, bound to the checkpoint
    (:mod:`expertcache.offload.densecache`: a second start reads them instead of packing); None packs every time.
    ``stats``: a dict that receives how (``dense_cache``: read / written / off / unwritable), where and in how
    many seconds they were made. An input embedding already replaced by a
    :class:`~expertcache.offload.diskembed.DiskEmbedding` is not read: its rows stay in the checkpoint."""
    used: set[str] = set()
    packed = packed or {}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = model.state_dict(keep_vars=True)
    missing = []
    with torch.no_grad():
        for name, t in state.items():
            key = _disk_key(ckpt, name)
            if key is None:
                if tied and name == "lm_head.weight":
                    continue
                missing.append(name)
                continue
            src = ckpt.tensor(key)
            _check_shape(ckpt, key, src.shape, t.shape)
            t.copy_(src)
            used.add(key)
        used.update(m.key for m in model.modules() if isinstance(m, DiskEmbedding))  # read on demand, not here
        sources = {}
        for name, mod in packed.items():
            key = _disk_key(ckpt, name)
            if key is None and tied and name == "lm_head.weight":
                key = _disk_key(ckpt, _input_embedding_name(model))
            if key is None:
                missing.append(name)
                continue
            rows, cols = (mod.out_features, mod.in_features) if hasattr(mod, "out_features") else \
                (mod.num_embeddings, mod.embedding_dim)
            _check_shape(ckpt, key, ckpt.entries[key].shape, (rows, cols))
            sources[name] = key
            used.add(key)
        if sources and not missing:
            def pack():
                for name, key in sources.items():
                    packed[name].load_rows(lambda a, b, key=key: ckpt.tensor(key, (a, b)))
            got = {n: packed[n] for n in sources}
            info = load_or_pack_dense(got, pack, ckpt, list(sources.values()),
                                      None if dense_cache is None else Path(dense_cache))
            for mod in got.values():
                getattr(mod, "finish", lambda: None)()
            if stats is not None:
                stats.update(info)
    release_free_heap()  # the reads' and the packing's freed blocks, given back before the expert slots are allocated
    if missing:
        raise CheckpointError(f"{ckpt.folder}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if tied and "lm_head.weight" not in packed:
        model.lm_head.weight = model.model.embed_tokens.weight
    extra = [k for k in ckpt.entries if k not in used and not ckpt.is_expert_key(k)]
    if extra:
        raise CheckpointError(f"{ckpt.folder}: unexpected tensors {extra[:5]} (unsupported layout?)")


def _disk_key(ckpt: Checkpoint, name: str) -> str | None:
    return next((k for k in ckpt.layout.disk_keys(name) if k in ckpt.entries), None)


def _check_shape(ckpt: Checkpoint, key: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(f"{ckpt.folder}: {key} has shape {list(got)}, the model expects {list(want)}")


def _input_embedding_name(model: nn.Module) -> str:
    emb = model.get_input_embeddings()
    return next(f"{name}.weight" for name, mod in model.named_modules() if mod is emb)


def recompute_rotary(model: nn.Module, config, device: torch.device) -> None:
    """Non-persistent buffers are not in the checkpoint: rebuild rotary-embedding modules (the only ones the
    supported families have; anything else raises). Modules whose buffers the loader packed (those with
    ``load_rows``: ``--quant-dense``) are left as they are."""
    for name, mod in list(model.named_modules()):
        if not mod._non_persistent_buffers_set or hasattr(mod, "load_rows"):
            continue
        if not type(mod).__name__.endswith("RotaryEmbedding"):
            raise RuntimeError(f"{name} ({type(mod).__name__}) has non-persistent buffers "
                               f"{sorted(mod._non_persistent_buffers_set)} that the offloaded loader cannot rebuild")
        with torch.device(device):
            fresh = type(mod)(config=config)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, fresh)
