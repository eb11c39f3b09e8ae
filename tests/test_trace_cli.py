"""`expertcache trace record|info` and `expertcache sensitivity` on a tiny model with toy local data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expertcache.cli.main import main
from expertcache.results import read_jsonl
from expertcache.trace import RoutingTrace

from figures_check import assert_drawn, record_figures


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from expertcache.eval.synthetic import save_tiny_with_tokenizer, write_toy_data

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("trace_cli")
    return (str(save_tiny_with_tokenizer("qwen2_moe", root / "model")),
            str(write_toy_data(root / "data", wikitext_rows=120)))


def test_record_wikitext_trace_matches_the_stock_router(env, tmp_path, capsys):
    model_dir, data_dir = env
    out = tmp_path / "assets" / "traces" / "demo.trace.safetensors"
    assert main(["trace", "record", "--model", model_dir, "--task", "wikitext", "--data-dir", data_dir,
                 "--tokens", "300", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    tr = RoutingTrace.load(out)
    m = tr.meta
    assert tr.num_tokens == 300 and m.sequence_starts == [0, 256] and m.top_k == 4 and m.num_experts == 8
    assert tr.logits_TLE.dtype == np.float16 and tr.weights_TLK is not None
    assert m.extra["context"] == 256 and m.extra["text"].startswith("wikitext")
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # atomic write, no temp files left
    # the recorded selections are the stock router's top-K, ordered by descending logit
    from expertcache.eval import load_model_and_tokenizer
    from expertcache.eval.tasks import WikiTextTask

    model, tok = load_model_and_tokenizer(model_dir)
    chunk = WikiTextTask(tok, context=256, data_dir=data_dir, limit=1).chunks_NS[:1]
    with torch.no_grad():
        out_ = model(chunk, output_router_logits=True)
    z_TE = out_.router_logits[0].float()  # first MoE layer, [T, E]
    top_TK = torch.topk(z_TE, 4, dim=-1).indices
    assert np.array_equal(tr.ids_TLK[:256, 0], top_TK.numpy())
    np.testing.assert_allclose(tr.logits_TLE[:256, 0].astype(np.float32), z_TE.numpy(), atol=1e-2, rtol=1e-3)


def test_record_text_file_no_weights_and_info(env, tmp_path, capsys):
    model_dir, _ = env
    text = tmp_path / "doc.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    out = tmp_path / "f.trace"
    assert main(["trace", "record", "--model", model_dir, "--task", "text-file", "--file", str(text),
                 "--tokens", "500", "--no-weights", "--device", "cpu", "--out", str(out)]) == 0
    tr = RoutingTrace.load(out)
    assert tr.weights_TLK is None and tr.num_tokens == 500  # 900 characters: 2 chunks of 256, cut to 500
    assert tr.meta.extra["text"] == "doc.txt" and tr.meta.extra["device"] == "cpu"
    capsys.readouterr()
    assert main(["trace", "info", str(out), "--capacity", "4"]) == 0
    info = capsys.readouterr().out
    assert f"{tr.num_tokens} tokens x 2 MoE layers" in info and "Belady" in info and "C=4/8" in info
    assert main(["simulate", str(out), "--policy", "cache-prior", "--lam", "0.5", "--json"]) == 0
    assert main(["trace", "record", "--model", model_dir, "--task", "text-file", "--out", str(out)]) == 2
    assert main(["trace", "info", str(tmp_path / "missing.trace")]) == 2


def test_shipped_demo_trace_is_small_enough():
    from expertcache.trace.demo import demo_trace_path

    try:
        path = demo_trace_path()
    except FileNotFoundError:
        pytest.skip("demo trace not recorded yet (expertcache trace record ...)")
    assert path.stat().st_size <= 3_000_000
    tr = RoutingTrace.load(path)
    assert tr.num_tokens >= 1024 and tr.logits_TLE.dtype == np.float16


def test_sensitivity_command(env, tmp_path, capsys):
    model_dir, data_dir = env
    rows_file, fig = tmp_path / "sens.jsonl", tmp_path / "sens.png"
    with record_figures() as drawn:
        assert main(["sensitivity", "--model", model_dir, "--data-dir", data_dir, "--limit", "1", "--out",
                     str(rows_file), "--fig", str(fig), "--no-progress"]) == 0
    rows = list(read_jsonl(rows_file))
    kinds = [(r["sensitivity"], r["rank"]) for r in rows]
    assert kinds == [("baseline", 0), ("drop", 2), ("drop", 3), ("drop", 4),
                     ("replace", 1), ("replace", 2), ("replace", 3), ("replace", 4)]
    base = rows[0]["quality"]
    assert all(r["quality"] != base for r in rows[1:])
    drop = {r["rank"]: r for r in rows if r["sensitivity"] == "drop"}
    assert drop[2]["config"]["routing"] == {**rows[0]["config"]["routing"], "policy": "prune", "h": 1}
    assert_drawn(fig, drawn, min_points=7)  # the 7 perturbed runs (and the baseline) are on the plot
    assert main(["sensitivity", "--model", model_dir, "--data-dir", data_dir, "--task", "mmlu"]) == 2
