"""Packed dense weights cached on disk (offload/densecache.py) and bound to their checkpoint (offload/binding.py):
a second start reads them instead of packing, computes the same logits, and never reads a cache made from other
weights, for another recipe, or damaged."""

from __future__ import annotations

import shutil

import pytest
import torch

from expertcache.offload.checkpoint import read_header

ATTN = "model.layers.0.self_attn.q_proj.weight"


def _olmoe(path, *, seed=1):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("olmoe", vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _olmoe(tmp_path_factory.mktemp("dense-cache") / "m")


def _start(path, dense, **kw):
    from expertcache.offload import OffloadConfig, OffloadedModel

    rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", quant_dense=dense, **kw), dtype=torch.float32)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.inference_mode():
        logits = rt.forward(ids).logits.float()
    info = rt.describe()["dense_load"]
    rt.close()
    return logits, info


def _flip(path, key: str, at: int = 3) -> None:
    """Change one byte of tensor ``key``'s data in the safetensors file ``path`` (same size, same header)."""
    e = read_header(path)[key]
    with open(path, "r+b") as f:
        f.seek(e.start + at)
        b = f.read(1)
        f.seek(e.start + at)
        f.write(bytes([b[0] ^ 0x55]))


@pytest.mark.parametrize("dense", ["int8", "int4"])
def test_second_start_reads_the_packed_weights_and_computes_the_same_logits(model_dir, dense, monkeypatch):
    from expertcache.offload.qlinear import QuantEmbedding, QuantLinear

    first, info1 = _start(model_dir, dense)
    assert info1["dense_cache"] == "written" and info1["path"].endswith(".safetensors")
    calls = []  # the second start must not pack: every load_rows is a call into the quantiser
    for cls in (QuantLinear, QuantEmbedding):
        real = cls.load_rows
        monkeypatch.setattr(cls, "load_rows", lambda self, *a, real=real, **k: (calls.append(1), real(self, *a, **k)))
    second, info2 = _start(model_dir, dense)
    assert info2 == dict(info2, dense_cache="read", path=info1["path"]) and not calls
    assert torch.equal(first, second)


def test_the_cache_is_bound_to_the_checkpoint_bytes(tmp_path):
    """An edit of one byte of one attention matrix (same shapes, same file size) misses the cache: the weights are
    packed again (a second file) and the logits are those of the edited checkpoint, not the cached ones."""
    path = _olmoe(tmp_path / "m")
    base, info = _start(path, "int8")
    _flip(path / "model.safetensors", ATTN)
    edited, info2 = _start(path, "int8")
    assert info2["dense_cache"] == "written" and info2["path"] != info["path"]
    assert not torch.equal(base, edited)
    fresh, info3 = _start(path, "int8")  # ... and is read back as the edited one's
    assert info3["dense_cache"] == "read" and torch.equal(fresh, edited)


def test_a_damaged_cache_is_packed_again_never_used(tmp_path, capsys):
    path = _olmoe(tmp_path / "m")
    want, info = _start(path, "int4")
    _flip(info["path"], f"{ATTN}:qweight", at=10)
    got, info2 = _start(path, "int4")
    assert info2["dense_cache"] == "written" and "checksum mismatch" in capsys.readouterr().err
    assert torch.equal(got, want)
    assert _start(path, "int4")[1]["dense_cache"] == "read"


def test_an_unwritable_cache_folder_costs_only_the_cache(tmp_path, monkeypatch, capsys):
    path = _olmoe(tmp_path / "m")
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("x")
    monkeypatch.setenv("EXPERTCACHE_CACHE", str(blocked))
    logits, info = _start(path, "int8")
    assert info["dense_cache"] == "unwritable" and "not cached" in capsys.readouterr().err
    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "ok"))
    assert torch.equal(_start(path, "int8")[0], logits)


def test_checkpoint_digest_reads_names_dtypes_shapes_and_bytes(tmp_path):
    """The digest is the same for a copy of the checkpoint elsewhere and changes with any source byte; a tensor's
    name is part of it (two keys' bytes swapped change it); keys not asked for do not count."""
    from expertcache.models.adapters import family_for
    from expertcache.offload.binding import checkpoint_digest
    from expertcache.offload.checkpoint import Checkpoint

    path = _olmoe(tmp_path / "a")
    copy = tmp_path / "b"
    shutil.copytree(path, copy)

    def digest(p, keys):
        from transformers import AutoConfig
        return checkpoint_digest(Checkpoint(p, family_for(AutoConfig.from_pretrained(p)).disk, 4), keys)

    keys = [ATTN, "model.layers.1.self_attn.o_proj.weight", "lm_head.weight"]
    d = digest(path, keys)
    assert len(d) == 32 and d == digest(copy, keys) == digest(path, list(reversed(keys)))
    assert digest(path, keys[:2]) != d
    _flip(copy / "model.safetensors", "model.layers.0.mlp.gate.weight")  # not a source key: same digest
    assert digest(copy, keys) == d
    _flip(copy / "model.safetensors", "lm_head.weight", at=101)
    assert digest(copy, keys) != d


def test_a_verified_file_is_read_without_hashing_until_it_changes(tmp_path, monkeypatch):
    """The checksum of the packed file is recomputed by the first process that reads it; later ones (its stamps
    remembered in $EXPERTCACHE_CACHE/digests) read it without hashing, with the same logits, until the file's
    stamps change (a touch moves its ctime): then it is hashed again."""
    import os

    from expertcache.offload import densecache

    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    path = _olmoe(tmp_path / "m")
    want, info = _start(path, "int8")
    assert info["dense_cache"] == "written"
    packed = sum(e.nbytes for k, e in read_header(info["path"]).items() if k != "__checksum__")
    hashed = []
    real = densecache._new_hash

    class Counting:
        def __init__(self):
            self.h = real()

        def update(self, b):
            hashed.append(len(memoryview(b).cast("B")))
            self.h.update(b)

        def digest(self):
            return self.h.digest()

    monkeypatch.setattr(densecache, "_new_hash", Counting)

    def start_in_a_new_process():
        hashed.clear()
        monkeypatch.setattr(densecache, "_VERIFIED", set())
        logits, i = _start(path, "int8")
        assert i["dense_cache"] == "read" and torch.equal(logits, want)
        return sum(hashed)

    assert start_in_a_new_process() == packed  # written by another process: checked once
    assert start_in_a_new_process() == 0  # remembered
    os.utime(info["path"])
    assert start_in_a_new_process() == packed  # touched: checked again
