"""`expertcache sweep` (grids, resumable JSONL) and `expertcache report` (Pareto table, figures)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expertcache.cli.main import main
from expertcache.eval.report import cache_size_curves, group_rows, pareto_front, pareto_markdown
from expertcache.eval.sweep import config_key, open_loop_row, plan, policy_grid, router_mass
from expertcache.results import read_jsonl
from expertcache.routing import RoutingConfig

from figures_check import assert_drawn, record_figures
from test_trace_sim import make_trace


@pytest.fixture()
def trace_file(tmp_path):
    torch.set_num_threads(1)
    return str(make_trace(t=200, l=2, e=8, k=2, starts=[0, 100]).save(tmp_path / "t.trace"))


def test_grids_follow_001():
    k, e = 8, 32
    assert [rc.h for rc in policy_grid("prune", k=k, num_experts=e)] == list(range(1, 9))
    assert [rc.m for rc in policy_grid("max-rank", k=k, num_experts=e)] == list(range(8, 33))
    lams = [rc.lam for rc in policy_grid("cache-prior", k=k, num_experts=e, top_j=2)]
    assert len(lams) == 50 and lams[0] == 0.0 and lams[-1] == 1.0 and np.all(np.diff(lams) > 0)
    assert all(rc.top_j == 2 for rc in policy_grid("cumsum", k=k, num_experts=e, top_j=2))
    assert [rc.p for rc in policy_grid("cumsum", k=k, num_experts=e, points=3)] == [0.0, 0.5, 1.0]
    assert [rc.beta for rc in policy_grid("eras-bias", k=k, num_experts=e, points=3, beta_max=2)] == [0.0, 1.0, 2.0]
    assert [rc.lam for rc in policy_grid("cache-prior", k=k, num_experts=e, strengths=[0.2, 0.7])] == [0.2, 0.7]
    runs = plan(mode="open-loop", source={"trace": "x"}, policies=["original", "cache-prior"], k=2, num_experts=8,
                capacities=["0.5", "4", 2], evictions=["lru", "belady"], points=3)
    # capacities deduplicated (0.5·8 = 4); belady only for fixed selections
    assert [r["capacity"] for r in runs] == [4] * 5 + [2] * 5
    assert sum(r["eviction"] == "belady" for r in runs) == 2
    assert len({config_key(r) for r in runs}) == len(runs)


def test_open_loop_row_proxy_and_bounds(trace_file):
    from expertcache.trace import RoutingTrace

    tr = RoutingTrace.load(trace_file)
    run = dict(mode="open-loop", source={"trace": trace_file}, routing=RoutingConfig().to_dict(), eviction="lru",
               capacity=4, gamma=None, initial="empty", seed=0, between_sequences="carry", scope=None)
    orig = open_loop_row(tr, run)
    assert orig["quality"] == pytest.approx(1.0) and orig["quality_name"] == "router_mass"
    assert orig["belady_miss_rate"] <= orig["miss_rate"]
    cp = open_loop_row(tr, {**run, "routing": RoutingConfig("cache-prior", lam=1.0).to_dict()})
    assert cp["miss_rate"] < orig["miss_rate"] and cp["quality"] < 1.0
    # proxy by hand: served mass / top-K mass
    z = np.array([[[0.0, 1.0, 2.0]]], dtype=np.float32)
    p = np.exp(z) / np.exp(z).sum()
    top2 = p[0, 0, 2] + p[0, 0, 1]
    assert router_mass(z, np.array([[[2, 0]]]), 2) == pytest.approx((p[0, 0, 2] + p[0, 0, 0]) / top2)
    assert router_mass(z, np.array([[[2, -1]]]), 2) == pytest.approx(p[0, 0, 2] / (p[0, 0, 2] + p[0, 0, 1]))


def test_sweep_resumes_and_appends_only_new_rows(trace_file, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    args = ["sweep", "--trace", trace_file, "--policies", "original,prune,cache-prior", "--grid", "3",
            "--capacity", "2,4", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    rows = list(read_jsonl(out))
    assert len(rows) == 2 * (1 + 2 + 3)
    assert len({r["sweep_key"] for r in rows}) == len(rows)
    assert all(r["version"] and "seed" in r and r["mode"] == "open-loop" and "miss_rate" in r for r in rows)
    # interruption: keep 4 whole rows plus a torn half line, then resume
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])
    assert main(args) == 0
    assert "8 runs appended" in capsys.readouterr().err
    resumed = list(read_jsonl(out))
    assert [r["sweep_key"] for r in resumed[:4]] == [r["sweep_key"] for r in rows[:4]]
    assert sorted(r["sweep_key"] for r in resumed) == sorted(r["sweep_key"] for r in rows)
    for a, b in zip(sorted(resumed, key=lambda r: r["sweep_key"]), sorted(rows, key=lambda r: r["sweep_key"])):
        assert a["miss_rate"] == b["miss_rate"] and a["quality"] == b["quality"]
    # a denser grid only adds its new points (0.25, 0.75 at both capacities)
    denser = [("5" if a == "3" else a) for a in args]  # --grid 5
    assert main(denser) == 0
    assert len(list(read_jsonl(out))) == 12 + 4
    assert main([*args, "--dry-run"]) == 0
    assert "12 runs planned, 0 pending" in capsys.readouterr().out


def test_sweep_closed_loop_tiny_model(tmp_path, capsys):
    from expertcache.eval.synthetic import save_tiny_with_tokenizer, write_toy_data

    model = save_tiny_with_tokenizer("mixtral", tmp_path / "m")
    data = write_toy_data(tmp_path / "d")
    out = tmp_path / "cl.jsonl"
    args = ["sweep", "--model", str(model), "--task", "wikitext", "--data-dir", str(data), "--limit", "1",
            "--policies", "original,cache-prior", "--strengths", "0,1", "--capacity", "4", "--out", str(out),
            "--no-progress"]
    assert main(args) == 0 and main(args) == 0
    rows = list(read_jsonl(out))
    assert len(rows) == 3 and {r["mode"] for r in rows} == {"closed-loop"}
    orig, lam0, lam1 = rows
    assert lam0["miss_rate"] == orig["miss_rate"] and lam1["miss_rate"] < orig["miss_rate"]
    assert orig["sweep"]["source"]["task"] == "wikitext" and orig["quality_name"] == "ppl"
    assert main(["sweep", "--trace", "x", "--task", "wikitext", "--out", str(out)]) == 2


def _row(policy, miss, q, higher=True, cap=4, **kw):
    return dict(mode="closed-loop", miss_rate=miss, quality=q, higher_is_better=higher, quality_name="accuracy",
                belady_miss_rate=kw.pop("belady", None), mean_lifetime=1.0,
                config=dict(capacity=cap, eviction="lru", num_experts=8, top_k=2, model="m", task={"task": "t"},
                            routing=RoutingConfig(policy, **kw).to_dict()))


def test_pareto_front_picks_non_dominated_rows():
    a = _row("original", 0.40, 0.70)
    b = _row("cache-prior", 0.30, 0.70, lam=0.3)  # dominates a (fewer misses, same accuracy)
    c = _row("cache-prior", 0.20, 0.65, lam=0.6)
    d = _row("max-rank", 0.25, 0.60, m=4)  # dominated by c
    e = _row("cumsum", 0.10, 0.50, p=0.9)
    f = _row("cumsum", 0.10, 0.50, p=1.0)  # identical to e: kept once
    front = pareto_front([a, b, c, d, e, f])
    assert front == [e, c, b]
    assert pareto_front([a, b, c, d, e, f], dedupe=False) == [e, f, c, b]
    # lower is better (perplexity): the direction flips
    lo = [_row("original", 0.4, 10.0, higher=False), _row("cache-prior", 0.3, 10.5, higher=False, lam=0.5),
          _row("cache-prior", 0.35, 11.0, higher=False, lam=0.4)]
    assert pareto_front(lo) == [lo[1], lo[0]]
    md = pareto_markdown(group_rows([a, b, c, d, e, f]))
    assert "| cache-prior | lam=0.3 |" in md and "max-rank" not in md and "| cumsum | p=0.9 |" in md
    assert "| cumsum | p=1 |" not in md


def test_cache_size_curves_respect_the_quality_budget():
    rows = []
    for cap, (m0, bel) in {2: (0.6, 0.55), 4: (0.4, 0.3)}.items():
        rows.append(_row("original", m0, 0.80, cap=cap, belady=bel))
        rows.append(_row("cache-prior", m0 - 0.1, 0.796, cap=cap, lam=0.2))  # 0.5% worse
        rows.append(_row("cache-prior", m0 - 0.2, 0.78, cap=cap, lam=0.5))  # 2.5% worse
        rows.append(_row("cache-prior", m0 - 0.3, 0.60, cap=cap, lam=0.9))  # 25% worse
    curves = cache_size_curves(rows)
    assert curves["original (LRU)"] == [(2, 0.6), (4, 0.4)]
    assert curves["original (Belady)"] == [(2, 0.55), (4, 0.3)]
    assert curves["cache-prior (≤1% worse)"] == [(2, pytest.approx(0.5)), (4, pytest.approx(0.3))]
    assert curves["cache-prior (≤5% worse)"] == [(2, pytest.approx(0.4)), (4, pytest.approx(0.2))]


def test_report_writes_table_and_figures(trace_file, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    assert main(["sweep", "--trace", trace_file, "--policies", "original,prune,max-rank,cache-prior", "--grid", "4",
                 "--capacity", "2,4", "--out", str(rows), "--no-progress"]) == 0
    sens = tmp_path / "sens.jsonl"
    from expertcache.results import append_jsonl

    for kind, r, q in (("baseline", 0, 10.0), ("drop", 2, 30.0), ("replace", 1, 50.0), ("replace", 2, 12.0)):
        append_jsonl(sens, dict(kind="sensitivity", sensitivity=kind, rank=r, quality=q, miss_rate=0.3,
                                config=dict(model="tiny", capacity=4, routing=RoutingConfig().to_dict())))
    capsys.readouterr()
    out_dir = tmp_path / "rep"
    with record_figures() as drawn:
        assert main(["report", str(rows), str(sens), "--out-dir", str(out_dir), "--trace", f"{trace_file}=orig",
                     "--trace", trace_file, "--layer", "1", "--start", "90", "--tokens", "50"]) == 0
    printed = capsys.readouterr().out
    md = (out_dir / "pareto.md").read_text()
    assert md.strip() in printed and md.count("## ") == 2
    pngs = sorted(p.name for p in out_dir.glob("*.png"))
    assert len([p for p in pngs if p.startswith("tradeoff-")]) == 2
    assert len([p for p in pngs if p.startswith("cache-size-")]) == 1
    assert "raster.png" in pngs and "sensitivity-tiny.png" in pngs
    for p in pngs:  # something was drawn: data artists on the axes and coloured ink in the PNG
        assert_drawn(out_dir / p, drawn, min_points=3)
    assert drawn["raster.png"]["image_pixels"] >= 2 * 50  # two traces x 50 tokens (x experts)
    assert drawn["sensitivity-tiny.png"]["points"] >= 3  # drop and replace curves over the ranks
    # the table lists exactly the non-dominated rows of each group
    from expertcache.eval.report import group_rows as gr

    for (_, _, cap, _), rs in gr(read_jsonl(rows)).items():
        table = md.split(f"cache {cap}/8")[1].split("## ")[0]
        assert table.count("\n| ") - 1 == len(pareto_front(rs))
    assert main(["report", "--out-dir", str(out_dir)]) == 2
