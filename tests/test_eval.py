"""Closed-loop evaluation (expertcache.eval, `expertcache eval`) on a tiny model with toy local data files.

Invariants: the original policy's perplexity / accuracy equal a direct computation with the stock model;
live miss rates equal the replay of the recorded selections and Belady never misses more; the KV-cached
greedy decoder equals full recomputation; the sensitivity perturbation replaces exactly one expert.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SHARED_DATA, needs_shared_data

from expertcache.cli.main import main
from expertcache.eval import build_task, context_length, evaluate, prepare
from expertcache.eval.data import final_number, load_gsm8k, load_mmlu, resolve_eval_data_dir, wikitext_text
from expertcache.eval.synthetic import save_tiny_with_tokenizer, write_toy_data
from expertcache.eval.tasks import greedy_generate
from expertcache.routing import RoutingConfig
from expertcache.sim import replay



@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """(model dir, data dir) of a tiny OLMoE with a character tokenizer and toy data."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("eval")
    model_dir = save_tiny_with_tokenizer("olmoe", root / "model")
    data_dir = write_toy_data(root / "data")
    return str(model_dir), str(data_dir)


@pytest.fixture(scope="module")
def wikitext(env):
    model_dir, data_dir = env
    return prepare(model_dir, "wikitext", data_dir=data_dir, limit=3)


def _stock(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_wikitext_preprocessing_and_original_ppl_equals_direct_hf(env, wikitext):
    model_dir, data_dir = env
    model, tok, task = wikitext
    ctx = context_length(model)
    assert ctx == 256  # min(1024, max_position_embeddings of the tiny config)
    text = wikitext_text(resolve_eval_data_dir("wikitext", data_dir))
    rows = [json.loads(x)["text"] for x in open(Path(data_dir) / "wikitext-2-raw-v1" / "test.jsonl")]
    assert text == "\n\n".join(rows)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert task.info["total_chunks"] == len(ids) // ctx and len(task) == 3
    assert task.chunks_NS[1].tolist() == ids[ctx:2 * ctx]

    row = evaluate(model, task, RoutingConfig(), capacity="0.5")
    stock = _stock(model_dir)
    nll, n = 0.0, 0
    with torch.no_grad():
        for c in task.chunks_NS:
            logits = stock(c[None]).logits[0, :-1]
            nll += torch.nn.functional.cross_entropy(logits, c[1:], reduction="sum").item()
            n += len(c) - 1
    assert row["quality_name"] == "ppl" and not row["higher_is_better"]
    assert row["quality"] == pytest.approx(math.exp(nll / n), rel=1e-9)
    assert row["task_metrics"]["predicted_tokens"] == n == 3 * 255


def test_eval_row_cache_metrics_are_consistent(wikitext, tmp_path):
    model, _, task = wikitext
    rows = {}
    for name, rc in {"orig": RoutingConfig(), "lam0": RoutingConfig("cache-prior", lam=0.0),
                     "cp": RoutingConfig("cache-prior", lam=0.8)}.items():
        rows[name] = evaluate(model, task, rc, capacity=4, between_sequences="reset",
                              trace_out=str(tmp_path / f"{name}.trace"))
    from expertcache.trace import RoutingTrace

    for name, row in rows.items():
        tr = RoutingTrace.load(tmp_path / f"{name}.trace")
        rep = replay(tr.ids_TLK, 8, 4, sequence_starts=tr.meta.sequence_starts, between_sequences="reset")
        assert row["miss_rate"] == pytest.approx(rep.miss_rate)
        assert row["belady_miss_rate"] <= row["miss_rate"] + 1e-12
        assert row["mean_lifetime"] > 0 and row["tokens"] == 3 * 256
        assert row["config"]["between_sequences"] == "reset" and row["config"]["capacity"] == 4
        assert row["version"] and "seed" in row and row["mode"] == "closed-loop"
        assert tr.meta.sequence_starts == [0, 256, 512]
    # zero strength = original routing (same selections, same counts, same quality up to float rounding)
    assert rows["lam0"]["miss_rate"] == rows["orig"]["miss_rate"]
    assert rows["lam0"]["quality"] == pytest.approx(rows["orig"]["quality"], rel=1e-5)
    assert rows["cp"]["miss_rate"] < rows["orig"]["miss_rate"]
    assert rows["cp"]["mean_lifetime"] > rows["orig"]["mean_lifetime"]


def test_between_sequences_reset_vs_carry(wikitext):
    model, _, task = wikitext
    reset = evaluate(model, task, RoutingConfig(), capacity=4, between_sequences="reset")
    carry = evaluate(model, task, RoutingConfig(), capacity=4, between_sequences="carry")
    assert reset["quality"] == carry["quality"]  # the original policy only observes the cache
    # a reset starts each chunk cold: at least one extra miss per expert re-loaded, never fewer misses
    assert reset["misses"] >= carry["misses"]


def test_mmlu_accuracy_equals_direct_letter_argmax(env):
    model_dir, data_dir = env
    model, tok, task = prepare(model_dir, "mmlu", data_dir=data_dir, limit=5)
    dev, test = load_mmlu(resolve_eval_data_dir("mmlu", data_dir))
    assert len(dev) == 2 and [q.subject for q in test[:4]] == ["toy_arithmetic", "toy_words"] * 2
    assert all(len(p) <= 256 for p in task.prompts) and 0 <= task.info["mean_shots"] <= 5
    assert task.letter_ids == [tok.convert_tokens_to_ids(" " + L) for L in "ABCD"]
    row = evaluate(model, task, RoutingConfig(), capacity=4)
    stock = _stock(model_dir)
    correct = 0
    with torch.no_grad():
        for ids, ans in zip(task.prompts, task.answers):
            logits = stock(torch.tensor([ids])).logits[0, -1]
            correct += int(int(logits[task.letter_ids].argmax()) == ans)
    assert row["quality"] == correct / 5 and row["quality_name"] == "accuracy"
    decoded = tok.decode(task.prompts[0])
    assert decoded.startswith("The following are multiple choice questions (with answers) about toy arithmetic.")
    assert decoded.endswith("\nD. " + decoded.split("\nD. ")[-1]) and decoded.endswith("Answer:")


def test_mmlu_score_by_hand(env):
    """MMLUTask.score (the scoring bench_mixed.py's closed loop shares): the letter with the highest logit, and
    the right letter's log-probability over the whole vocabulary, computed here by hand."""
    model_dir, data_dir = env
    _, tok, task = prepare(model_dir, "mmlu", data_dir=data_dir, limit=1)
    V = len(tok)
    logits_V = torch.zeros(V)
    logits_V[task.letter_ids] = torch.tensor([1.0, 3.0, 2.0, 0.5])
    logits_V[0] = 5.0  # a non-letter token above every letter: never the prediction
    norm = math.log((V - 5) + math.exp(5.0) + math.exp(1.0) + math.exp(3.0) + math.exp(2.0) + math.exp(0.5))
    predicted, logp = task.score(logits_V, 2)
    assert predicted == 1 and logp == pytest.approx(2.0 - norm, abs=1e-5)
    assert task.score(logits_V.to(torch.bfloat16), 0)[0] == 1
    logits_V[3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        task.score(logits_V, 0)


def test_greedy_generate_equals_full_recompute(env):
    model_dir, _ = env
    model = _stock(model_dir)
    prompt = [5, 17, 33, 40, 41, 60]
    fast = greedy_generate(model, prompt, 12)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert fast == seq[len(prompt):]


def test_gsm8k_generation_scope_and_metrics(env):
    model_dir, data_dir = env
    model, tok, task = prepare(model_dir, "gsm8k", data_dir=data_dir, limit=2, max_new_tokens=16)
    assert task.default_scope == "generation" and task.max_new_tokens == 16
    orig = evaluate(model, task, RoutingConfig(), capacity=4)
    cp = evaluate(model, task, RoutingConfig("cache-prior", lam=1.0), capacity=4)
    assert orig["config"]["scope"] == "generation"
    for row in (orig, cp):
        n_gen = row["generation_tokens"]
        assert 0 < n_gen <= 2 * 15
        assert row["tokens"] == n_gen + sum(len(p) for p in task.prompts)
        assert 0 <= row["generation_miss_rate"] <= 1 and row["quality"] in (0.0, 0.5, 1.0)
    assert cp["generation_miss_rate"] <= orig["generation_miss_rate"]


def test_final_number_and_gsm_loader(env):
    _, data_dir = env
    assert final_number("so 3 + 4 = 7 apples.\n#### 1,234") == "1234"
    assert final_number("The answer is $12.50.") == "12.5"
    assert final_number("it is 7.0") == "7" and final_number("no digits") is None
    assert final_number("-3 degrees") == "-3"
    probs = load_gsm8k(resolve_eval_data_dir("gsm8k", data_dir), "train")
    assert len(probs) == 8 and "<<" not in probs[0].answer and probs[0].target == final_number(probs[0].answer)


def test_replace_rank_perturbation(wikitext):
    model, _, task = wikitext
    base = evaluate(model, task, RoutingConfig(), capacity=4)
    from expertcache.models import patch_model

    x = task.chunks_NS[:1]
    with patch_model(model, RoutingConfig(), record=True, replace_rank=2, seed=3) as p:
        model(x)
        tr = p.trace()
    # closed loop: later layers see perturbed hidden states, so compare with each token's own logits
    top_TLK = np.argsort(-tr.logits_TLE.astype(np.float32), axis=-1, kind="stable")[..., :2]
    t, n_l, k = tr.ids_TLK.shape
    for ti in range(t):
        for li in range(n_l):
            o, r = set(top_TLK[ti, li].tolist()), set(tr.ids_TLK[ti, li].tolist())
            assert len(o - r) == 1 and len(r - o) == 1  # exactly one expert swapped ...
            assert (o - r) == {int(top_TLK[ti, li, 1])}  # ... the one at rank 2, for one outside the top-K
    r1 = evaluate(model, task, RoutingConfig(), capacity=4, replace_rank=1, seed=0)
    r1b = evaluate(model, task, RoutingConfig(), capacity=4, replace_rank=1, seed=0)
    assert r1["quality"] == r1b["quality"] != base["quality"]
    assert r1["config"]["replace_rank"] == 1
    with pytest.raises(ValueError, match="replace_rank"):
        evaluate(model, task, RoutingConfig("cache-prior", lam=0.5), replace_rank=1)
    with pytest.raises(ValueError, match="replace_rank"):
        evaluate(model, task, RoutingConfig(), replace_rank=3)  # K = 2


def test_missing_data_names_the_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPERTCACHE_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--data-dir.*EXPERTCACHE_DATA"):
        resolve_eval_data_dir("mmlu")
    assert main(["eval", "--model", "nowhere", "--task", "wikitext", "--data-dir", str(tmp_path)]) == 2


def test_cli_eval_json_and_out(env, tmp_path, capsys):
    model_dir, data_dir = env
    out = tmp_path / "rows.jsonl"
    assert main(["eval", "--model", model_dir, "--task", "wikitext", "--data-dir", data_dir, "--limit", "1",
                 "--policy", "cache-prior", "--lam", "0.5", "--capacity", "4", "--json", "--no-progress",
                 "--out", str(out)]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["config"]["routing"]["policy"] == "cache-prior" and row["config"]["task"]["items"] == 1
    assert json.loads(out.read_text()) == row
    assert main(["eval", "--model", model_dir, "--task", "wikitext", "--data-dir", data_dir, "--limit", "1",
                 "--capacity", "4", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "closed loop" in text and "ppl" in text and "Belady" in text
    assert main(["eval", "--model", model_dir, "--task", "wikitext", "--data-dir", data_dir, "--eviction",
                 "belady"]) == 2


@needs_shared_data("wikitext-2-raw-v1", "mmlu", "gsm8k")
def test_real_local_data_sets_load():
    folder = SHARED_DATA / "wikitext-2-raw-v1"
    joined = folder / "test.joined.txt"
    if joined.exists():
        assert wikitext_text(folder) == joined.read_text(encoding="utf-8")
    dev, test = load_mmlu(SHARED_DATA / "mmlu")
    assert len(dev) == 57 and sum(map(len, dev.values())) == 285 and len(test) == 14042
    assert len({q.subject for q in test[:57]}) == 57
    gsm = load_gsm8k(SHARED_DATA / "gsm8k", "test")
    assert len(gsm) == 1319 and all(g.target for g in gsm)


@needs_shared_data("wikitext-2-raw-v1", "mmlu", "gsm8k")
def test_shipped_model_tasks_build_within_context():
    from expertcache.assets import shipped_model_dir

    try:
        shipped_model_dir("granular")
    except FileNotFoundError:
        pytest.skip("shipped model not installed")
    from expertcache.eval import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("granular")
    ctx = context_length(model)
    mmlu = build_task("mmlu", tok, context=ctx, data_dir=SHARED_DATA, limit=20)
    assert all(len(p) <= ctx for p in mmlu.prompts) and len(set(mmlu.letter_ids)) == 4
    gsm = build_task("gsm8k", tok, context=ctx, data_dir=SHARED_DATA, limit=5)
    assert all(len(p) + gsm.max_new_tokens <= ctx for p in gsm.prompts)
