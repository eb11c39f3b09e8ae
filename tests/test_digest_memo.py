"""The checkpoint digests that bind a quantised sidecar and the packed dense cache to their checkpoint
(offload/binding.py) are remembered across processes in $EXPERTCACHE_CACHE/digests/: a second start must not read
every expert byte again (18.9 s of an 8-layer OLMoE-1B-7B shape's 25 s to the first token), yet a changed file --
even one whose mtime was put back -- must be hashed again, and a damaged memo must never be believed."""

from __future__ import annotations

import hashlib
import os
import time

import pytest
import torch

from expertcache.offload import binding
from expertcache.offload.checkpoint import Checkpoint, read_header


def _olmoe(path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("olmoe", vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    return path, cfg


@pytest.fixture()
def ckpt(tmp_path, monkeypatch):
    from expertcache.models.adapters import family_for

    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(binding, "_MEMO", {})
    path, cfg = _olmoe(tmp_path / "m")
    return lambda: Checkpoint(path, family_for(cfg).disk, cfg.num_experts)


def _no_reads(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the checkpoint's bytes were read")
    monkeypatch.setattr(binding, "_hash_range", boom)


def _independent_tensor_digest(ck, keys):
    """checkpoint_digest's documented formula, computed here from the header and the file's bytes."""
    h = hashlib.blake2b(digest_size=binding.DIGEST_BYTES)
    for key in sorted(keys):
        t = ck.entries[key]
        h.update(f"{key}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0{t.nbytes}\0".encode())
        with open(t.file, "rb") as f:
            f.seek(t.start)
            h.update(f.read(t.nbytes))
    return h.hexdigest()


def test_a_later_process_reads_the_experts_digest_from_the_memo_not_the_bytes(ckpt, tmp_path, monkeypatch):
    first = binding.source_digest(ckpt(), [0, 1])
    assert list((tmp_path / "cache" / "digests").glob("*.json"))
    monkeypatch.setattr(binding, "_MEMO", {})  # a new process
    _no_reads(monkeypatch)
    assert binding.source_digest(ckpt(), [0, 1]) == first


def test_the_dense_digest_is_remembered_and_equals_the_formula(ckpt, monkeypatch):
    ck = ckpt()
    keys = [k for k in ck.entries if "self_attn" in k]
    want = _independent_tensor_digest(ck, keys)
    assert binding.checkpoint_digest(ck, keys) == want
    monkeypatch.setattr(binding, "_MEMO", {})
    _no_reads(monkeypatch)
    assert binding.checkpoint_digest(ckpt(), keys) == want


def test_a_changed_file_with_its_mtime_put_back_is_hashed_again(ckpt, monkeypatch):
    ck = ckpt()
    before = binding.source_digest(ck, [0, 1])
    keys = [k for k in ck.entries if "self_attn" in k]
    dense_before = binding.checkpoint_digest(ck, keys)
    file = next(iter({str(t.file) for t in ck.entries.values()}))
    st = os.stat(file)
    time.sleep(0.05)  # past the kernel's coarse clock tick, so the change moves ctime
    expert_key = next(k for k in read_header(file) if ".mlp.experts." in k)
    attn_key = keys[0]
    with open(file, "r+b") as f:
        for key in (expert_key, attn_key):
            e = read_header(file)[key]
            f.seek(e.start + 1)
            b = f.read(1)
            f.seek(e.start + 1)
            f.write(bytes([b[0] ^ 0x55]))
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same size, inode and mtime as before
    assert os.stat(file).st_mtime_ns == st.st_mtime_ns and os.stat(file).st_size == st.st_size
    monkeypatch.setattr(binding, "_MEMO", {})
    ck2 = ckpt()
    assert binding.source_digest(ck2, [0, 1]) != before
    assert binding.checkpoint_digest(ck2, keys) == _independent_tensor_digest(ck2, keys) != dense_before


@pytest.mark.parametrize("damage", ["not json", "[1, 2]", '{"key": "x", "digest": "00"}', "digest"])
def test_a_damaged_memo_is_never_believed(ckpt, tmp_path, monkeypatch, damage):
    ck = ckpt()
    keys = [k for k in ck.entries if "self_attn" in k]
    want = binding.checkpoint_digest(ck, keys)
    (memo,) = (tmp_path / "cache" / "digests").glob("*.json")
    if damage == "digest":  # the right key with another digest of the right form is the one case it trusts:
        text = memo.read_text()   # a wrong digest of a wrong form must not pass
        memo.write_text(text.replace(want, "zz" * binding.DIGEST_BYTES))
    else:
        memo.write_text(damage)
    monkeypatch.setattr(binding, "_MEMO", {})
    assert binding.checkpoint_digest(ckpt(), keys) == want


def test_a_verified_sidecar_is_not_read_again_by_a_later_process_until_its_bytes_change(ckpt, tmp_path, monkeypatch):
    """verify_quant_sidecar hashes every blob once; a later process trusts the memo for the same stamps, and a
    blob damaged in place (its mtime put back) is caught again."""
    from expertcache.offload import store
    from expertcache.offload.checkpoint import CheckpointError

    ck = ckpt()
    monkeypatch.setattr(store, "_VERIFIED", set())
    sidecar = store.quantize_checkpoint(ck, [0, 1], "int8", out=tmp_path / "side.safetensors")
    monkeypatch.setattr(store, "_VERIFIED", set())
    store.verify_quant_sidecar(sidecar)  # one process checks every blob
    monkeypatch.setattr(store, "_VERIFIED", set())  # a new process
    calls = []
    real = store._digest
    monkeypatch.setattr(store, "_digest", lambda data: calls.append(1) or real(data))
    store.verify_quant_sidecar(sidecar)
    assert calls == []  # the memo, not the bytes
    st = os.stat(sidecar)
    time.sleep(0.05)
    e = next(t for k, t in read_header(sidecar).items() if k.endswith(".qblob"))
    with open(sidecar, "r+b") as f:
        f.seek(e.start + 2)
        b = f.read(1)
        f.seek(e.start + 2)
        f.write(bytes([b[0] ^ 0x55]))
    os.utime(sidecar, ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.setattr(store, "_VERIFIED", set())
    with pytest.raises(CheckpointError, match="fails its checksum"):
        store.verify_quant_sidecar(sidecar)
