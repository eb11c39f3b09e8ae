"""The token embedding read from the checkpoint on demand (offload/diskembed.py) and the memory plan's terms it
changes: a forward's rows are exactly the full matrix's (prefill batches, repeated ids, decode), the plan no
longer counts the matrix, tied embeddings keep the matrix, the runtime computes the same logits as with the
matrix held; and the plan's interpreter term inside a memory cgroup (its charge where smaller than RSS)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from expertcache.offload.checkpoint import read_header
from expertcache.offload.diskembed import DiskEmbedding, embedding_mode, use_disk_embedding

V, D = 97, 24


@pytest.fixture
def table(tmp_path):
    """A safetensors file with a tensor before the embedding (so its data does not start at the data section)."""
    torch.manual_seed(0)
    w = torch.randn(V, D, dtype=torch.float32)
    path = tmp_path / "m.safetensors"
    save_file({"a.before": torch.randn(5, 7), "emb.bf16": w.to(torch.bfloat16), "emb.f32": w}, str(path))
    return path, w


def _disk(path, key, dtype):
    e = read_header(path)[key]
    return DiskEmbedding(e.file, e.start, e.shape[0], e.shape[1], e.dtype, dtype, key=key)


@pytest.mark.parametrize("key,dtype", [("emb.bf16", torch.bfloat16), ("emb.bf16", torch.float32),
                                       ("emb.f32", torch.bfloat16), ("emb.f32", torch.float32)])
def test_rows_are_the_full_matrix_rows(table, key, dtype):
    """Prefill (a batch with repeated ids, first and last row, runs of consecutive ids) and decode (one id, [1, 1]):
    exactly ``F.embedding`` of the whole stored matrix converted to the compute dtype."""
    path, w = table
    full = (w.to(torch.bfloat16) if key == "emb.bf16" else w).to(dtype)
    emb = _disk(path, key, dtype)
    for ids in (torch.tensor([[3, 5, 3, 0, V - 1, 4, 5, 6]]), torch.tensor([[1, 2], [2, 1], [V - 1, V - 1]]),
                torch.tensor([[7]]), torch.tensor([V - 1]), torch.tensor([[42, 42, 42]])):
        got = emb(ids)
        want = nn.functional.embedding(ids, full)
        assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want)
    assert not list(emb.parameters()) and not list(emb.buffers())  # holds no matrix


def test_out_of_range_ids_raise(table):
    emb = _disk(table[0], "emb.bf16", torch.float32)
    for bad in ([V], [-1], [0, V + 3]):
        with pytest.raises(IndexError):
            emb(torch.tensor([bad]))


def _olmoe_skeleton(tied: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("olmoe", vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                               tie_word_embeddings=tied)
    torch.manual_seed(1)
    return cfg, AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def olmoe_dir(request, tmp_path_factory):
    cfg, model = _olmoe_skeleton(request.param)
    path = tmp_path_factory.mktemp("diskemb") / "m"
    model.save_pretrained(path)
    return path, request.param


def _checkpoint(path, config):
    from expertcache.models.adapters import family_for
    from expertcache.offload.checkpoint import Checkpoint

    return Checkpoint(path, family_for(config).disk, config.num_experts)


@pytest.mark.parametrize("mode", ["int8", "int4", "int4-head8", None])
def test_the_plan_counts_no_embedding_matrix_and_tied_models_keep_it(olmoe_dir, mode, monkeypatch):
    """``dense_bytes`` of the skeleton drops exactly the embedding's held bytes (computed here: V·D codes and V
    bf16 scales for int8 rows (``--quant-dense`` int8 and int4); V·D/2 codes and a bf16 scale and zero per group for
    int4 rows (int4-head8); V·D bf16 when not quantised); a tied model's embedding is left as it is (``use_disk_embedding`` returns None)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from expertcache.offload.qlinear import DENSE_GROUP, dense_bytes

    monkeypatch.delenv("EXPERTCACHE_EMBEDDING", raising=False)
    path, tied = olmoe_dir
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    before = dense_bytes(model, mode)
    got = use_disk_embedding(model, _checkpoint(path, config), config, torch.device("cpu"), torch.bfloat16)
    if tied:
        assert got is None and type(model.get_input_embeddings()) is nn.Embedding
        assert dense_bytes(model, mode) == before
        return
    v, d, g = config.vocab_size, config.hidden_size, DENSE_GROUP
    int4 = mode == "int4-head8" and d % (2 * g) == 0  # int4 rows only there (--quant-dense int4 keeps them int8)
    held = 2 * v * d if mode is None else v * d // 2 + 2 * 2 * v * (d // g) if int4 else v * d + 2 * v
    assert isinstance(model.get_input_embeddings(), DiskEmbedding)
    assert before - dense_bytes(model, mode) == held


def test_not_on_gpu_not_compiled_and_not_when_asked_for_ram(olmoe_dir, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    path, tied = olmoe_dir
    if tied:
        pytest.skip("tied: never replaced")
    config = AutoConfig.from_pretrained(path)
    ckpt = _checkpoint(path, config)

    def fresh():
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)

    assert use_disk_embedding(fresh(), ckpt, config, torch.device("cuda"), torch.bfloat16) is None
    assert use_disk_embedding(fresh(), ckpt, config, torch.device("cpu"), torch.bfloat16, compiled=True) is None
    monkeypatch.setenv("EXPERTCACHE_EMBEDDING", "ram")
    assert use_disk_embedding(fresh(), ckpt, config, torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setenv("EXPERTCACHE_EMBEDDING", "bogus")
    with pytest.raises(ValueError, match="EXPERTCACHE_EMBEDDING"):
        embedding_mode()


@pytest.mark.parametrize("dense", [None, "int8"])
def test_runtime_embeds_the_checkpoint_rows_and_computes_the_held_matrix_logits(olmoe_dir, dense, monkeypatch, tmp_path):
    """The offloaded runtime (untied): its embedding returns the checkpoint's rows (read here with safetensors) in
    the compute dtype, also beside ``--quant-dense int8`` (exact rows, not int8 ones); with nothing quantised its
    logits (prefill and one-token decode) equal those of the same runtime holding the matrix
    (``EXPERTCACHE_EMBEDDING=ram``). Tied: the matrix is held either way."""
    from safetensors.torch import load_file

    from expertcache.offload import OffloadConfig, OffloadedModel

    monkeypatch.setenv("EXPERTCACHE_CACHE", str(tmp_path / "cache"))
    path, tied = olmoe_dir
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 17]])
    w = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"].to(torch.float32)

    def run(mode):
        monkeypatch.setenv("EXPERTCACHE_EMBEDDING", mode)
        rt = OffloadedModel.from_pretrained(path, OffloadConfig(tier="host", quant_dense=dense), dtype=torch.float32)
        emb = rt.model.get_input_embeddings()
        with torch.inference_mode():
            rows = emb(ids)
            out = rt.forward(ids).logits.float()
            step = rt.forward(ids[:, :1]).logits.float()  # one token: the decode shape
        rt.close()
        return type(emb), rows, out, step

    kind, rows, disk, disk1 = run("disk")
    if tied:
        assert kind is not DiskEmbedding
        return
    assert kind is DiskEmbedding and torch.equal(rows, nn.functional.embedding(ids, w))
    if dense is None:
        kind_ram, rows_ram, ram, ram1 = run("ram")
        assert kind_ram is nn.Embedding and torch.equal(rows, rows_ram)
        assert torch.equal(disk, ram) and torch.equal(disk1, ram1)


def test_interpreter_term_is_the_cgroup_charge_where_smaller(tmp_path, monkeypatch):
    """A fake cgroup-v1 tree: the charge below RSS is the term; above RSS (other processes, page cache) RSS is;
    no cgroup (or not planning against one): RSS."""
    from expertcache.container import cgroup_memory_usage
    from expertcache.offload import preflight as pf

    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("5:memory:/box\n")
    box = tmp_path / "sys/fs/cgroup/memory/box"
    box.mkdir(parents=True)
    (box / "memory.limit_in_bytes").write_text(str(2**30))
    monkeypatch.setattr(pf, "process_rss", lambda: 500 * 2**20)
    (box / "memory.usage_in_bytes").write_text(str(340 * 2**20))
    assert cgroup_memory_usage(tmp_path) == 340 * 2**20
    assert pf.interpreter_bytes(tmp_path, True) == 340 * 2**20
    assert pf.interpreter_bytes(tmp_path, False) == 500 * 2**20
    (box / "memory.usage_in_bytes").write_text(str(700 * 2**20))
    assert pf.interpreter_bytes(tmp_path, True) == 500 * 2**20
    (tmp_path / "proc/self/cgroup").write_text("0::/box2\n")  # v2, no such file: RSS
    assert cgroup_memory_usage(tmp_path) is None and pf.interpreter_bytes(tmp_path, True) == 500 * 2**20


def test_melinoe_model_embedder_reads_the_rows_on_demand(table):
    """MeLinoe's ``model`` embedder (mean of the input embeddings) gives the same vectors from a DiskEmbedding as
    from the full matrix (it used ``.weight``, which a DiskEmbedding has not)."""
    from expertcache.melinoe.predictor import ModelEmbedder

    path, w = table

    class Tok:
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % V for c in text]}

    class Holder:
        def __init__(self, emb):
            self.emb = emb

        def get_input_embeddings(self):
            return self.emb

    full = nn.Embedding(V, D)
    full.weight.data.copy_(w.to(torch.bfloat16).float())
    texts = ["hello", "a", "zz top"]
    want = ModelEmbedder(Holder(full), Tok()).encode(texts)
    got = ModelEmbedder(Holder(_disk(path, "emb.bf16", torch.float32)), Tok()).encode(texts)
    assert got.shape == want.shape == (3, D) and (got == want).all()
