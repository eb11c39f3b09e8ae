"""MELINOE (004): losses against hand-worked cases, the L_cs gradient on the router, fine-tune end to end
(loadable checkpoint, resume), the predictor (train, save, load) and --predictor prefetch counting."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from expertcache.melinoe.losses import cache_sim_loss, rank_match_loss, request_vector, soft_cache_states


def _p(top_ids, e=3):
    """Router probabilities [1, 1, T, E] whose top-1 is ``top_ids`` (values irrelevant for the hard value)."""
    p = torch.full((1, 1, len(top_ids), e), 0.2)
    for t, i in enumerate(top_ids):
        p[0, 0, t, i] = 0.6
    return p / p.sum(-1, keepdim=True)


def test_cache_sim_loss_fill_phase_hand_worked():
    # K=1, C=1, γ=0.5, requests e0, e0, e1; fill start c1 = 0
    # t1: 1·(1-0) = 1; Count2 = [1,0,0], ‖‖=1 ≤ C: c2 = [1,0,0], t2: 1-1 = 0;
    # Count3 = [1.5,0,0], Z = 1.5: c3 = [1,0,0], t3 (e1): 1-0 = 1  ->  L_cs = 2/3
    p = _p([0, 0, 1])
    assert float(cache_sim_loss(p, 1, 1, 0.5, start="fill")) == pytest.approx(2 / 3)
    c = soft_cache_states(request_vector(p, 1), 1, 0.5, "fill")
    assert c[0, 0].flatten().tolist() == pytest.approx([0, 0, 0, 1, 0, 0, 1, 0, 0])


def test_cache_sim_loss_uniform_start_hand_worked():
    # Count1 = [1/3]*3 (‖‖ = C = 1): t1 = 2/3; Count2 = [7/6, 1/6, 1/6], Z = 1.5: c2 = [7/9, 1/9, 1/9], t2 = 2/9;
    # Count3 = [19/12, 1/12, 1/12], Z = 1.75: c3 = [19/21, 1/21, 1/21], t3 (e1) = 20/21
    p = _p([0, 0, 1])
    want = (2 / 3 + 2 / 9 + 20 / 21) / 3
    assert float(cache_sim_loss(p, 1, 1, 0.5, start="uniform")) == pytest.approx(want)


def test_soft_cache_norm_follows_z_recursion():
    # after the fill phase ‖c‖₁ = C, and c^(t+1) = (γ Z c + r) / Z' with Z' = γ Z + K/C (004 Prop. C.3)
    torch.manual_seed(0)
    k, cap, g = 2, 4, 0.9
    p = torch.softmax(torch.randn(2, 3, 40, 8), -1)
    r = request_vector(p, k)
    c = soft_cache_states(r, cap, g, "uniform")
    assert c.sum(-1).detach().numpy() == pytest.approx(np.full((2, 3, 40), cap), rel=1e-5)
    z = 1.0
    for t in range(39):
        z_next = g * z + k / cap
        assert torch.allclose(c[:, :, t + 1], (g * z * c[:, :, t] + r[:, :, t]) / z_next, atol=1e-5)
        z = z_next
    cf = soft_cache_states(r, cap, g, "fill")
    norms = cf.sum(-1).detach()
    assert float(norms[..., 0].max()) == 0 and float(norms[..., 1].min()) == pytest.approx(k)
    assert float(norms.max()) == pytest.approx(cap, rel=1e-5)


def test_rank_match_loss_hand_worked():
    pb = torch.tensor([0.5, 0.3, 0.2])
    pf = torch.tensor([0.2, 0.5, 0.3])
    # pairs (0,1): [0.1 + 0.3]+ = 0.4; (0,2): [0.1 + 0.1]+ = 0.2; (1,2): [0.1 - 0.2]+ = 0
    assert float(rank_match_loss(pf, pb, 0.1)) == pytest.approx(0.6)
    assert float(rank_match_loss(pb, pb, 0.0)) == 0.0  # same order, no margin: no mistakes
    # lower bound of Lemma C.8: m ≥ ρ · inversions (here 2 inversions)
    assert float(rank_match_loss(pf, pb, 0.1)) >= 0.1 * 2


def test_request_vector_value_is_the_top_k_mask():
    p = torch.softmax(torch.randn(5, 8), -1)
    for mode in ("st", "masked"):
        r = request_vector(p, 3, mode)
        mask = (r.detach() > 0)
        assert mask.sum(-1).tolist() == [3] * 5
    assert torch.equal(request_vector(p, 3, "st").detach(), request_vector(p, 3, "st").detach().round())
    with pytest.raises(ValueError):
        request_vector(p, 3, "hard")


@pytest.mark.parametrize("mode", ["st", "masked"])
def test_cache_sim_loss_has_a_gradient_on_the_router(mode):
    from expertcache.melinoe.finetune import RouterTap
    from expertcache.models.adapters import family_for, find_moe_layers
    from expertcache.models.tiny import build_tiny

    model = build_tiny("olmoe", seed=0)
    layers = find_moe_layers(model, family_for(model))
    tap = RouterTap(layers)
    x = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    model(input_ids=x, use_cache=False)
    pf = tap.stacked(2, 24)
    loss = cache_sim_loss(pf, layers[0].top_k, 4, 0.9, request=mode)
    loss.backward()
    for m in layers:
        g = m.router.weight.grad
        assert g is not None and float(g.abs().sum()) > 0
    tap.remove()


def test_rank_match_base_is_the_base_models_own_forward():
    """p_b of L_rm is what the base model routes on the same tokens: equal to a second, independent full forward
    of a freshly loaded base (its router logits from transformers' output_router_logits, no hooks), also when
    the fine-tuned routers have moved -- where the frozen base router applied to the fine-tuned hidden states
    (the earlier p_b) differs from layer 1 on."""
    pytest.importorskip("peft")
    from expertcache.assets import shipped_model_dir
    from expertcache.melinoe.finetune import BaseRouting, FinetuneConfig, RouterTap, build_trainable, step_losses
    from expertcache.models import load_model

    src = shipped_model_dir("granular")
    cfg = FinetuneConfig(lora_r=2, lora_alpha=1.0)
    pm, layers, _ = build_trainable(load_model(src), cfg)
    base_w = [m.router.weight.detach().clone() for m in layers]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a fine-tuned model whose routing differs from the base's
        for m in layers:
            m.router.weight.add_(0.3 * torch.randn(m.router.weight.shape, generator=g))
    inputs = []
    handles = [m.router.register_forward_hook(lambda mod, a, o: inputs.append(a[0].detach())) for m in layers]
    tap, base = RouterTap(layers), BaseRouting(load_model(src))
    xy = torch.randint(3, 8000, (2, 25), generator=g)
    x, y = xy[:, :-1], xy[:, 1:]
    res = step_losses(pm, tap, base, x, y, cfg, 8, 8)
    for h in handles:
        h.remove()
    ref = load_model(src)(input_ids=x, use_cache=False, output_router_logits=True).router_logits
    want = torch.stack([torch.softmax(r.float(), -1).view(2, 24, -1) for r in ref], dim=1)
    assert res["pb"].shape == want.shape == (2, 4, 24, 32)
    assert torch.allclose(res["pb"], want, atol=1e-5)
    assert res["rm"].item() == pytest.approx(float(rank_match_loss(res["pf"], want, cfg.rho)), rel=1e-5)
    assert not torch.allclose(res["pf"], want, atol=1e-3)  # the fine-tuned routing did move
    # the earlier p_b: base router weights on the fine-tuned hidden states -- equal in layer 0 only
    old = torch.stack([torch.softmax(h.reshape(-1, w.shape[1]) @ w.T, -1).view(2, 24, -1)
                       for h, w in zip(inputs, base_w)], dim=1)
    assert torch.allclose(old[:, 0], want[:, 0], atol=1e-5)
    assert not torch.allclose(old[:, 1:], want[:, 1:], atol=1e-3)
    tap.remove()
    base.remove()


def test_presets_fill_what_the_flags_leave():
    from expertcache.cli.main import build_parser
    from expertcache.melinoe.finetune import PRESETS, FinetuneConfig, apply_preset

    cfg = apply_preset(FinetuneConfig(preset="004"))
    assert (cfg.lr, cfg.lambda_cs, cfg.lambda_rm, cfg.lora_r, cfg.lora_alpha, cfg.warmup_ratio) == (
        1e-4, 0.5, 0.1, 32, 16.0, 0.03)  # 004 Table 7 (lr scaled: see PRESETS["004"]["lr"])
    assert cfg.steps * cfg.batch_size * cfg.seq_len >= 3 * cfg.train_tokens  # 3 epochs
    assert all(why for rec in PRESETS.values() for _, why in rec.values())  # every value says why
    fast = FinetuneConfig()  # the dataclass defaults are the fast preset
    assert all(getattr(fast, k) == v for k, (v, _) in PRESETS["fast"].items())
    assert apply_preset(FinetuneConfig(preset="004", lr=0.5), {"lr"}).lr == 0.5
    with pytest.raises(ValueError, match="--preset"):
        apply_preset(FinetuneConfig(preset="paper"))
    # the CLI: --preset 004 with --steps 5 keeps the 5 and takes the rest from the preset
    from expertcache.cli.melinoe import finetune_config

    got = finetune_config(build_parser().parse_args(["melinoe", "finetune", "--preset", "004", "--steps", "5"]))
    assert (got.steps, got.lr, got.lora_r, got.seq_len) == (5, 1e-4, 32, 256)
    # without --steps the 004 preset runs 3 epochs of the token budget given
    got = finetune_config(build_parser().parse_args(["melinoe", "finetune", "--preset", "004",
                                                     "--train-tokens", "400000"]))
    assert got.steps == 586 == math.ceil(3 * 400000 / (8 * 256))


# ---------------------------------------------------------------------------------------------
# fine-tuning end to end


def _write_corpus(path, n_docs=40, seed=0):
    rng = random.Random(seed)
    words = ("apt package debian kernel module python install file system user config network server boot "
             "driver memory process thread socket path").split()
    path.mkdir(parents=True)
    for f in range(2):
        with open(path / f"part{f}.jsonl", "w") as fh:
            for i in range(n_docs // 2):
                text = " ".join(rng.choice(words) for _ in range(rng.randint(80, 200)))
                fh.write(json.dumps({"source": f"doc-{f}-{i}", "text": text}) + "\n")


def _ft_cfg(tmp_path, name, steps):
    from expertcache.melinoe.finetune import FinetuneConfig

    return FinetuneConfig(model="granular", out=str(tmp_path / name), data_dir=str(tmp_path / "corpus"), steps=steps,
                          batch_size=2, seq_len=32, train_tokens=4000, eval_tokens=256, log_every=1, ckpt_every=1,
                          lora_r=2, lora_alpha=1.0)


def test_finetune_writes_a_loadable_checkpoint_and_resumes(tmp_path):
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from expertcache.melinoe.finetune import finetune
    from expertcache.models import load_model
    from expertcache.offload import OffloadConfig, OffloadedModel

    _write_corpus(tmp_path / "corpus")
    path = finetune(_ft_cfg(tmp_path, "a", 3), progress=False)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "melinoe_summary.json", "losses.png"):
        assert (path / f).is_file(), f
    rows = [json.loads(l) for l in open(tmp_path / "a" / "log.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["cs"]) for r in rows)
    summary = json.loads((path / "melinoe_summary.json").read_text())
    assert summary["capacity"] == 8 and math.isfinite(summary["heldout"]["ppl"])
    # the merged checkpoint: no LoRA keys, same tensor names as the base; routers and gate rows moved
    from expertcache.assets import shipped_model_dir

    base = load_file(str(shipped_model_dir("granular") / "model.safetensors"))
    tuned = load_file(str(path / "model.safetensors"))
    assert set(tuned) == set(base)
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(base[router], tuned[router])
    gu = "model.layers.0.mlp.experts.0.gate_proj.weight"  # saved unfused, one tensor per expert
    assert not torch.equal(base[gu], tuned[gu])
    moved = [k for k in base if not torch.equal(base[k], tuned[k])]
    assert any(".up_proj." in k for k in moved) and any(".down_proj." in k for k in moved)  # LoRA merged
    assert not any("self_attn" in k or "embed" in k or "norm" in k for k in moved)  # frozen
    # it loads where a checkpoint loads: load_model and the offloaded runtime
    m = load_model(path)
    assert m(input_ids=torch.tensor([[5, 6, 7]])).logits.shape[-1] == m.config.vocab_size
    rt = OffloadedModel.from_pretrained(path, OffloadConfig(capacity=8, io="cached"))
    out = rt.generate(torch.tensor([[5, 6, 7, 8]]), 3)
    assert out["tokens"].shape == (1, 3)
    # resume: 2 steps, then the same command again to 3 steps == 3 steps at once
    cfg = _ft_cfg(tmp_path, "b", 3)
    finetune(cfg, progress=False, stop_at=2)
    assert json.loads((tmp_path / "b" / "state" / "state.json").read_text())["step"] == 2
    path_b = finetune(_ft_cfg(tmp_path, "b", 3), progress=False)
    tuned_b = load_file(str(path_b / "model.safetensors"))
    for key in (router, gu, "model.layers.0.mlp.experts.3.down_proj.weight"):
        assert torch.allclose(tuned[key].float(), tuned_b[key].float(), atol=1e-2), key


def test_finetune_bad_inputs_are_clear(tmp_path):
    from expertcache.cli.main import main

    assert main(["melinoe", "finetune", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert main(["melinoe", "finetune", "--steps", "0", "--out", str(tmp_path / "o")]) == 2
    assert main(["melinoe", "finetune", "--request", "hard", "--out", str(tmp_path / "o")]) == 2
    (tmp_path / "file").write_text("x")
    assert main(["melinoe", "finetune", "--out", str(tmp_path / "file")]) == 2
    assert main(["melinoe", "finetune", "--out", str(tmp_path / "o"), "--data-dir", str(tmp_path / "none")]) == 2
    assert main(["melinoe", "predictor", "--out", str(tmp_path / "file")]) == 2
    assert main(["melinoe", "predictor", "--capacities", "8,x", "--out", str(tmp_path / "p")]) == 2
    assert main(["melinoe", "predictor", "--embedder", "bert", "--out", str(tmp_path / "p")]) == 2


# ---------------------------------------------------------------------------------------------
# predictor and prefetch


def _tiny_predictor(tmp_path, model_name="granular"):
    """A predictor for the shipped granular model from a handful of synthetic prompts (the 'model' embedder)."""
    from expertcache.melinoe.predictor import PredictorConfig, train_predictor

    _write_corpus(tmp_path / "corpus", n_docs=24)
    cfg = PredictorConfig(model=model_name, out=str(tmp_path / "pred"), data_dir=str(tmp_path / "corpus"),
                          embedder="model", train_prompts=16, heldout_prompts=4, prompt_len=8, cont_len=6,
                          hidden=32, epochs=3, capacities="4,8")
    return cfg, train_predictor(cfg, progress=False)


def test_predictor_trains_saves_and_loads(tmp_path, monkeypatch):
    import expertcache.train.data as data
    from expertcache.melinoe.predictor import Predictor, topc_metrics

    monkeypatch.setattr(data, "is_heldout", lambda source: source.endswith(("-0", "-1", "-2")))
    cfg, report = _tiny_predictor(tmp_path)
    assert set(report["topc"]) == {"4", "8"}
    for r in report["topc"].values():
        for who in ("predictor", "prior", "oracle"):
            assert 0 <= r[who]["precision"] <= 1 and 0 <= r[who]["recall"] <= 1
        assert r["oracle"]["overlap"] == 1.0
    p = Predictor.load(cfg.out)
    assert (p.num_layers, p.num_experts) == (4, 32) and p.meta["embedder"] == "model"
    from expertcache.eval.runner import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("granular")
    pred = p.predict(["apt install a package", "kernel module driver"], model, tok)
    assert pred.shape == (2, 4, 32) and np.allclose(pred.sum(-1), 1, atol=1e-5)
    sets = p.prefetch_sets(["apt install a package", "kernel module driver"], 8, model, tok)
    pooled = pred.mean(0)
    assert [sorted(s) for s in sets] == [sorted(np.argsort(-row)[:8].tolist()) for row in pooled]
    with pytest.raises(FileNotFoundError):
        Predictor.load(tmp_path / "nowhere")
    # metrics by hand: 1 prompt, 1 layer, E=4; predicted top-2 {0, 1}; requests: e0 x3, e2 x1
    m = topc_metrics(np.array([[[0.4, 0.3, 0.2, 0.1]]]), np.array([[[3.0, 0, 1, 0]]]),
                     np.array([[[0.5, 0.1, 0.3, 0.1]]]), 2)
    assert m == dict(precision=0.5, recall=0.75, overlap=0.5)


def test_prefetch_is_counted_apart_from_misses(tmp_path, monkeypatch):
    import expertcache.train.data as data
    from expertcache.melinoe.predictor import Predictor
    from expertcache.melinoe.prefetch import prefetch_cache, prefetch_runtime
    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.assets import shipped_model_dir
    from expertcache.cache import make_cache

    # a cache: the prefetch step is not a demand access
    for kind in ("lru", "gamma", "lfu"):
        c = make_cache(kind, 8, 3)
        assert prefetch_cache(c, [5, 6, 7, 5]) == 3 and c.resident() == {5, 6, 7}
        assert (c.stats.accesses, c.stats.misses, c.stats.hits) == (0, 0, 0)
        c.access_step([5, 0])
        assert (c.stats.accesses, c.stats.misses, c.stats.hits) == (2, 1, 1)
    # the offloaded runtime: generate with and without the predictor's prefetch
    monkeypatch.setattr(data, "is_heldout", lambda source: source.endswith(("-0", "-1", "-2")))
    cfg, _ = _tiny_predictor(tmp_path)
    p = Predictor.load(cfg.out)
    from transformers import AutoTokenizer

    path = shipped_model_dir("granular")
    tok = AutoTokenizer.from_pretrained(path)
    prompt = "The Debian package manager installs software"
    ids = tok(prompt, return_tensors="pt").input_ids
    rt = OffloadedModel.from_pretrained(path, OffloadConfig(capacity=8, io="cached"))
    n = prefetch_runtime(rt, p, [prompt], tok)
    assert n == 4 * 8
    s0 = rt.stats()
    assert s0["prefetched"] == 32 and s0["misses"] == 0 and s0["accesses"] == 0
    out = rt.generate(ids, 4)
    s1 = rt.stats()
    assert s1["prefetched"] == 32 and s1["accesses"] > 0
    assert s1["hits"] + s1["misses"] == s1["accesses"]
    assert s1["expert_loads"] == s1["misses"] + 32  # every load is either a demand miss or a prefetch
    rt.configure()
    rt.generate(ids, 4)
    s2 = rt.stats()
    assert s2["prefetched"] == 0 and s2["expert_loads"] == s2["misses"]
    # the CLI: generate --predictor prints the prefetch count; a bad path fails with exit code 2
    from expertcache.cli.main import main

    assert main(["generate", "--model", "granular", "--cache-experts", "8", "--io", "cached", "--max-new-tokens", "3",
                 "--predictor", cfg.out, prompt]) == 0
    assert main(["generate", "--model", "granular", "--predictor", str(tmp_path / "nope"), prompt]) == 2


def test_eval_with_predictor_counts_prefetches(tmp_path, monkeypatch):
    import expertcache.train.data as data
    from expertcache.eval import evaluate
    from expertcache.eval.runner import load_model_and_tokenizer
    from expertcache.eval.tasks import WikiTextTask
    from expertcache.melinoe.predictor import Predictor
    from expertcache.melinoe.prefetch import PatchPrefetcher, item_prompt_texts
    from expertcache.routing import RoutingConfig

    monkeypatch.setattr(data, "is_heldout", lambda source: source.endswith(("-0", "-1", "-2")))
    cfg, _ = _tiny_predictor(tmp_path)
    p = Predictor.load(cfg.out)
    model, tok = load_model_and_tokenizer("granular")
    task = WikiTextTask(tok, context=32, text="apt install the package and the kernel module " * 30, limit=3)
    rows = {}
    for name, pre in (("none", None), ("prefetch", lambda patch, t: PatchPrefetcher(
            p, item_prompt_texts(t, tok, 8), model, tok).install(patch))):
        rows[name] = evaluate(model, task, RoutingConfig(), eviction="lru", capacity=8, between_sequences="reset",
                              prefetch=pre)
    assert "prefetched" not in rows["none"]
    assert rows["prefetch"]["prefetched_items"] == 3 and 0 < rows["prefetch"]["prefetched"] <= 3 * 4 * 8
    # same requests (original routing does not depend on the cache), fewer or equal demand misses
    assert rows["prefetch"]["quality"] == pytest.approx(rows["none"]["quality"])
    miss = lambda r: r["miss_rate"]
    assert miss(rows["prefetch"]) <= miss(rows["none"])
    # transfers count every load: demand misses + prefetch loads (caches reset empty per item, so each item's
    # prefetch loads its C experts in each of the 4 layers)
    assert rows["prefetch"]["prefetched"] == 3 * 4 * 8
    for r in rows.values():
        assert r["transfers"] == r["misses"] + r.get("prefetched", 0)
        assert r["transfers_per_token_layer"] == pytest.approx(r["transfers"] / (3 * 32 * 4))
    # the MELINOE report row (benchmarks/bench_melinoe.py) counts them too
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_melinoe", Path(__file__).parents[1] / "benchmarks" /
                                                  "bench_melinoe.py")
    bm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bm)
    rep = bm.closed_loop(model, tok, task, RoutingConfig(), "lru", 8, p, 8)
    assert rep["misses"] == rows["prefetch"]["misses"] and rep["prefetched"] == 96
    assert rep["transfers_per_token_layer"] * 3 * 32 * 4 == pytest.approx(rep["misses"] + 96)
    assert rep["transfers_per_token_layer"] > rep["demand_misses_per_token_layer"]
    # net transfers: against the same requests without prefetching (original routing: the plain run's misses)
    assert rep["misses_without_prefetch"] == rows["none"]["misses"]
    assert rows["prefetch"]["net_transfers"] == rows["prefetch"]["transfers"] - rows["none"]["misses"]
    assert {"predictor_recall", "prior_recall", "predictor_beats_prior"} <= set(rows["prefetch"])
