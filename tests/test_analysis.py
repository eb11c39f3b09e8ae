"""Activation profiling (003 Fig. 3, 4, 6), the ERAS profile file, and ``expertcache analyze``, on
hand-made traces whose answers are known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from expertcache.analysis import (activation_frequency, activation_rate, analyze, distinct_experts,
                                  expert_correlation, layer_correlation, load_freq, load_profile, router_signal,
                                  save_profile, top_pairs, uniform_distinct)
from expertcache.cli.main import main
from expertcache.outputs import FILES_MARK
from expertcache.sim import activation_frequency as sim_frequency
from expertcache.trace import RoutingTrace, TraceMeta

from figures_check import assert_drawn, record_figures


def trace_of(z_TLE: np.ndarray, k: int, starts=None) -> RoutingTrace:
    z_TLE = np.asarray(z_TLE, dtype=np.float32)
    t, l, e = z_TLE.shape
    ids = np.argsort(-z_TLE, axis=-1, kind="stable")[..., :k]
    return RoutingTrace(z_TLE, ids, TraceMeta("hand-made", e, k, False, l, source="test",
                                              sequence_starts=starts or [0]))


def random_trace(t=600, l=3, e=8, k=2, seed=0, starts=None) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    return trace_of(rng.normal(size=(t, l, e)) + np.linspace(0, 1.5, e), k, starts)


# -- activation frequency (Fig. 3) ---------------------------------------------------------------


def test_frequency_counts_and_normalisations():
    ids = np.array([[[0, 1]], [[0, 2]], [[0, 1]], [[3, -1]]])  # T=4, L=1, K=2; one dropped slot
    rate = activation_rate(ids, 4)
    np.testing.assert_allclose(rate, [[3 / 4, 2 / 4, 1 / 4, 1 / 4]])
    freq = activation_frequency(ids, 4)
    np.testing.assert_allclose(freq, [[3 / 7, 2 / 7, 1 / 7, 1 / 7]], rtol=1e-6)


def test_frequency_rows_sum_to_one_and_rates_to_k():
    tr = random_trace(k=3)
    freq = activation_frequency(tr.ids_TLK, 8)
    np.testing.assert_allclose(freq.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(activation_rate(tr.ids_TLK, 8).sum(axis=1), 3.0)
    np.testing.assert_array_equal(freq, sim_frequency(tr.ids_TLK, 8))  # the ERAS profile the simulator uses


# -- correlation (Fig. 4) -------------------------------------------------------------------------


def test_layer_copying_another_has_correlation_one():
    rng = np.random.default_rng(1)
    z0 = rng.normal(size=(500, 8))
    perm = rng.permutation(8)
    z = np.stack([z0, z0[:, perm], rng.normal(size=(500, 8))], axis=1)  # layer 1 = layer 0 relabelled
    tr = trace_of(z, k=2)
    for signal in ("probs", "selected"):
        corr = expert_correlation(router_signal(tr.logits_TLE, tr.ids_TLK, signal=signal))
        for e in range(8):  # expert perm[e] of layer 1 is expert e of layer 0 ... as feature 8 + j
            j = int(np.flatnonzero(perm == e)[0])
            assert corr[e, 8 + j] == pytest.approx(1.0, abs=1e-6)
        s = layer_correlation(corr, 3)
        assert s[0, 1] == pytest.approx(1.0, abs=1e-6) and s[1, 0] == pytest.approx(1.0, abs=1e-6)
        assert s[0, 2] < 0.25 and s[2, 1] < 0.25  # independent layer: sampling noise only
    pairs = top_pairs(corr, 3, n=8)
    assert {(p["layer_a"], p["layer_b"]) for p in pairs} == {(0, 1)}
    assert all(p["corr"] == pytest.approx(1.0, abs=1e-6) for p in pairs)


def test_correlation_is_pearson_and_constant_features_are_nan():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(300, 2, 3))
    x[:, 1, 2] = 5.0  # constant feature
    corr = expert_correlation(x)
    ref = np.corrcoef(x.reshape(300, 6)[:, :5], rowvar=False)
    np.testing.assert_allclose(corr[:5, :5], ref, atol=1e-10)
    assert np.isnan(corr[5]).all() and np.isnan(corr[:, 5]).all()
    assert np.isfinite(layer_correlation(corr, 2)).all()


def test_router_signal_softmax_sigmoid_and_indicators():
    z = np.array([[[0.0, np.log(3.0)]]])
    np.testing.assert_allclose(router_signal(z), [[[0.25, 0.75]]])
    np.testing.assert_allclose(router_signal(z, scoring="sigmoid"), [[[0.5, 0.75]]])
    np.testing.assert_array_equal(router_signal(z, np.array([[[1]]]), signal="selected"), [[[0.0, 1.0]]])
    np.testing.assert_array_equal(router_signal(z, np.array([[[-1]]]), signal="selected"), [[[0.0, 0.0]]])


# -- distinct experts vs batch size (Fig. 6) -----------------------------------------------------


@pytest.mark.parametrize("mode", ["random", "consecutive"])
def test_distinct_experts_batch_one_is_k_and_bounded(mode):
    tr = random_trace(k=2, starts=[0, 250])
    d = distinct_experts(tr.ids_TLK, 8, 12, mode=mode, samples=64, sequence_starts=tr.meta.sequence_starts)
    assert d.shape == (12, 3)
    np.testing.assert_array_equal(d[0], 2.0)
    b = np.arange(1, 13)[:, None]
    assert (d <= np.minimum(8, 2 * b)).all() and (np.diff(d, axis=0) > -0.5).all()


def test_distinct_experts_exact_on_hand_made_selections():
    # layer 0 always picks {0, 1}; layer 1 cycles through disjoint pairs {0,1}, {2,3}, {4,5}, {6,7}
    t = 8
    ids = np.zeros((t, 2, 2), dtype=np.int64)
    ids[:, 0] = [0, 1]
    ids[:, 1] = np.array([[0, 1], [2, 3], [4, 5], [6, 7]] * 2)
    d = distinct_experts(ids, 8, 4, mode="consecutive")
    np.testing.assert_array_equal(d[:, 0], [2, 2, 2, 2])
    np.testing.assert_array_equal(d[:, 1], [2, 4, 6, 8])  # consecutive windows never repeat a pair
    d = distinct_experts(ids, 8, 8, mode="random", samples=32)
    assert d[7, 1] == 8 and d[7, 0] == 2  # all 8 tokens: every expert of layer 1


def test_consecutive_windows_stay_inside_sequences():
    ids = np.zeros((6, 1, 1), dtype=np.int64)
    ids[3:, 0, 0] = 1  # sequence 0 uses expert 0, sequence 1 expert 1
    d = distinct_experts(ids, 2, 4, mode="consecutive", sequence_starts=[0, 3])
    np.testing.assert_array_equal(d[:3, 0], [1, 1, 1])  # a window never spans both sequences
    assert np.isnan(d[3, 0])  # no sequence has 4 tokens


def test_uniform_reference():
    np.testing.assert_allclose(uniform_distinct(8, 2, 3), [2.0, 8 * (1 - 0.75 ** 2), 8 * (1 - 0.75 ** 3)])


# -- the ERAS profile on disk and simulate --freq-from ---------------------------------------------


@pytest.mark.parametrize("suffix", [".npy", ".json"])
def test_profile_round_trip(tmp_path, suffix):
    freq = activation_frequency(random_trace().ids_TLK, 8)
    path = save_profile(tmp_path / f"p{suffix}", freq, meta={"model": "m"})
    np.testing.assert_array_equal(load_profile(path), freq)
    np.testing.assert_array_equal(load_freq(path, 3, 8), freq)
    with pytest.raises(ValueError, match="needs"):
        load_freq(path, 4, 8)


def test_profile_bad_files(tmp_path):
    with pytest.raises(ValueError, match=".npy or .json"):
        save_profile(tmp_path / "p.txt", np.zeros((2, 2)))
    (tmp_path / "bad.json").write_text('{"nofreq": 1}')
    with pytest.raises(ValueError, match="not a readable activation profile"):
        load_profile(tmp_path / "bad.json")
    np.save(tmp_path / "bad.npy", np.zeros(3))
    with pytest.raises(ValueError, match=r"\[L, E\]"):
        load_profile(tmp_path / "bad.npy")


def test_simulate_freq_from_profile_equals_freq_from_trace(tmp_path, capsys):
    profile_tr = random_trace(seed=3)
    sim_tr = random_trace(seed=4)
    tp, sp = profile_tr.save(tmp_path / "profile.trace"), sim_tr.save(tmp_path / "sim.trace")
    npy, js = tmp_path / "freq.npy", tmp_path / "freq.json"
    assert main(["analyze", str(tp), "--profile-out", str(npy)]) == 0
    assert main(["analyze", str(tp), "--profile-out", str(js)]) == 0
    capsys.readouterr()
    rows = []
    for src in (tp, npy, js):
        assert main(["simulate", str(sp), "--policy", "eras-bias", "--beta", "2", "--capacity", "4",
                     "--freq-from", str(src), "--json"]) == 0
        rows.append(json.loads(capsys.readouterr().out))
    assert rows[0]["miss_rate"] == rows[1]["miss_rate"] == rows[2]["miss_rate"]
    assert rows[0]["layer_miss_rates"] == rows[1]["layer_miss_rates"]
    bad = tmp_path / "bad.npy"
    np.save(bad, np.full((2, 8), 1 / 8, dtype=np.float32))
    assert main(["simulate", str(sp), "--policy", "eras-bias", "--beta", "2", "--freq-from", str(bad)]) == 2
    assert "[L, E] = [2, 8]" in capsys.readouterr().err


# -- analyze() and the command ---------------------------------------------------------------------


def test_analyze_summary_is_json_and_consistent():
    tr = random_trace(k=2)
    a = analyze(tr, max_batch=6, samples=32)
    s = json.loads(json.dumps(a.summary, allow_nan=False))
    assert s["trace"]["tokens"] == 600 and s["config"]["max_batch"] == 6
    assert s["distinct_experts"]["mean_by_batch"][0] == 2.0
    assert len(s["correlation"]["adjacent_layers"]) == 2
    np.testing.assert_allclose(s["frequency"]["rate_row_sums"], 2.0)
    assert a.corr_FF.shape == (24, 24) and a.layer_corr_LL.shape == (3, 3)


def test_analyze_block_by_block_summary_equals_full_matrix(monkeypatch):
    import expertcache.analysis as analysis

    tr = random_trace(l=3)
    full = analyze(tr, max_batch=2, samples=8)
    monkeypatch.setattr(analysis, "MAX_FULL_CORRELATION", 8)  # force the large-model path
    blocks = analyze(tr, max_batch=2, samples=8)
    assert blocks.corr_FF is None
    np.testing.assert_allclose(blocks.layer_corr_LL, full.layer_corr_LL, atol=1e-12)


def test_analyze_command_writes_figures_summary_and_profile(tmp_path, capsys):
    path = random_trace(starts=[0, 300]).save(tmp_path / "t.trace")
    out = tmp_path / "figs"
    with record_figures() as drawn:
        assert main(["analyze", str(path), "--out-dir", str(out), "--profile-out", str(tmp_path / "f.npy"),
                     "--max-batch", "5", "--samples", "16", "--batch-mode", "consecutive"]) == 0
    text = capsys.readouterr().out
    assert "distinct experts" in text and "b=4" in text
    names = sorted(p.name for p in out.iterdir() if p.name != FILES_MARK)  # + the record of what it wrote
    assert names == ["analysis_correlation.png", "analysis_distinct.png", "analysis_frequency.png",
                     "analysis_summary.json"]
    for n in names[:3]:
        assert_drawn(out / n, drawn)
    summary = json.loads((out / "analysis_summary.json").read_text())
    assert summary["config"]["batch_mode"] == "consecutive"
    assert load_profile(tmp_path / "f.npy").shape == (3, 8)


def test_analyze_bad_input_is_one_clear_line(tmp_path, capsys):
    path = random_trace().save(tmp_path / "t.trace")
    assert main(["analyze", str(path), "--profile-out", str(tmp_path / "f.txt")]) == 2
    assert "--profile-out must end in .npy or .json" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "missing.trace")]) == 2
    assert "Traceback" not in capsys.readouterr().err


# -- the Router's per-token Cache-Prior path (routing/config.py, made fast for bench_patch.py) -------
# (lives here because tests/test_routing.py belongs to another workstream; move it there when convenient)


@pytest.mark.parametrize("e, k, j, lam, fixed", [(8, 2, 1, 0.5, None), (32, 8, 1, 0.3, None),
                                                 (16, 4, 2, 1.0, 2.0), (8, 3, 0, 0.7, None)])
def test_router_one_token_cache_prior_equals_the_oracle(e, k, j, lam, fixed):
    import torch

    import oracles
    from expertcache.routing import Router, RoutingConfig

    g = torch.Generator().manual_seed(e * 100 + k)
    router = Router(RoutingConfig("cache-prior", lam=lam, top_j=j, delta=fixed), num_experts=e, k=k,
                    renormalize=False)
    running = oracles.RunningDelta()
    for step in range(400):
        z = torch.randn(1, e, generator=g) * 2
        if step % 3 == 0:  # bf16-rounded logits: many exact ties
            z = z.to(torch.bfloat16).float()
        if step % 7 == 0:
            z[0, :3] = z[0, 0]  # ties at the top
        resident = torch.rand(e, generator=g) < 0.5
        d = running.see(z[0].numpy()) if fixed is None else fixed
        want = oracles.cache_prior(z[0].numpy(), resident.tolist(), k, lam, j, d)
        if step % 2:
            resident = resident.unsqueeze(0)
        got = router.rank(3, z, resident)
        assert got.dtype == torch.int64 and got.shape == (1, k)
        assert sorted(got[0].tolist()) == sorted(want), (step, z, resident)
    if fixed is None:
        assert (router.delta_for(3).total, router.delta_for(3).count) == (running.total, running.count)
