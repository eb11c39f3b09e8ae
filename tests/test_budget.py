"""Budget-targeted routing: the miss-rate controller (pure), the BudgetRouter hook, closed loop on a model."""

from __future__ import annotations

import math
import random

import pytest
import torch

from expertcache.routing import Router, RoutingConfig
from expertcache.routing.budget import BudgetRouter, attach
from expertcache.routing.controller import ControllerConfig, MissRateController


def _plant(strength: float, base: float, rng: random.Random, k: int = 8) -> int:
    """A toy plant: each of K slots misses with probability base · exp(-strength / 0.1)."""
    p = base * math.exp(-strength / 0.1)
    return sum(rng.random() < p for _ in range(k))


@pytest.mark.parametrize("target", [0.02, 0.05, 0.1])
def test_controller_reaches_the_target_on_a_monotone_plant(target):
    rng = random.Random(0)
    ctl = MissRateController(ControllerConfig(target=target), num_layers=2, k=8)
    for _ in range(3000):
        for layer in range(2):
            ctl.update(layer, _plant(ctl.strength(layer), 0.2, rng))
    assert ctl.miss_rate() == pytest.approx(target, rel=0.1)
    # the strength it settled on is the one the plant needs: base · exp(-s / 0.1) = target
    assert ctl.strength(0) == pytest.approx(-0.1 * math.log(target / 0.2), rel=0.35)
    assert ctl.saturated == [None, None]


def test_unreachable_target_saturates_and_does_not_wind_up():
    ctl = MissRateController(ControllerConfig(target=0.5), num_layers=1, k=8)  # the plant never exceeds 0.2
    rng = random.Random(1)
    for _ in range(2000):
        ctl.update(0, _plant(ctl.strength(0), 0.2, rng))
    assert ctl.saturated == ["min"]
    # anti-windup: once the plant can exceed the target again (base 1.0), it recovers within a few hundred tokens
    for _ in range(400):
        ctl.update(0, _plant(ctl.strength(0), 1.0, rng))
    assert ctl.saturated == [None]


def test_per_layer_mode_holds_one_strength_per_layer():
    ctl = MissRateController(ControllerConfig(target=0.05, per_layer=True), num_layers=2, k=8)
    rng = random.Random(2)
    for _ in range(2000):
        ctl.update(0, _plant(ctl.strength(0), 0.2, rng))
        ctl.update(1, _plant(ctl.strength(1), 0.1, rng))
    assert ctl.strength(0) > ctl.strength(1)  # the layer that misses more needs more bias
    assert ctl.miss_rate(0) == pytest.approx(0.05, rel=0.15) and ctl.miss_rate(1) == pytest.approx(0.05, rel=0.15)


@pytest.mark.parametrize("kw, match", [(dict(target=0.0), "target"), (dict(target=1.5), "target"),
                                       (dict(target=0.1, s_min=0.0), "range"),
                                       (dict(target=0.1, s0=5.0), "initial strength")])
def test_controller_config_checks(kw, match):
    with pytest.raises(ValueError, match=match):
        ControllerConfig(**kw)
    with pytest.raises(ValueError, match="cache-prior .* or eras-bias"):
        ControllerConfig.for_policy("cumsum", 0.1)


def test_budget_router_ranks_like_the_router_at_its_level_and_counts_misses():
    torch.manual_seed(0)
    e, k = 16, 4
    base = Router(RoutingConfig("cache-prior", lam=0.0), num_experts=e, k=k, renormalize=False)
    ctl = MissRateController(ControllerConfig(target=0.1), num_layers=2, k=k)
    br = BudgetRouter(base, ctl)
    assert br.kernel_params(0) is None and br.k == k
    for t in range(50):
        z = torch.randn(1, e)
        resident = torch.rand(e) < 0.4
        lam = ctl.strength(1)
        ref = Router(RoutingConfig("cache-prior", lam=lam), num_experts=e, k=k, renormalize=False)
        ref.deltas = {1: type(base.delta_for(1))(fixed=None, total=base.delta_for(1).total,
                                                  count=base.delta_for(1).count)}
        before = ctl.layers[1].misses
        ids = br.rank(1, z, resident)
        assert sorted(ids[0].tolist()) == sorted(ref.rank(1, z, resident)[0].tolist())
        assert ctl.layers[1].misses - before == int((~resident[ids[0]]).sum())


def test_budget_router_rejects_other_policies():
    base = Router(RoutingConfig("cumsum", p=0.5), num_experts=8, k=2, renormalize=False)
    with pytest.raises(ValueError, match="cache-prior or eras-bias"):
        BudgetRouter(base, MissRateController(ControllerConfig(target=0.1), num_layers=1, k=2))


def test_closed_loop_on_a_tiny_model_hits_the_target():
    """attach() in a patched model: the controller's count equals the cache's, and the running miss rate
    ends within 10 % of a target between the original routing's and the strongest setting's."""
    from expertcache.models import patch_model
    from expertcache.models.tiny import build_tiny

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build_tiny("mixtral")
    ids = torch.randint(0, model.config.vocab_size, (1, 600))
    with patch_model(model, RoutingConfig("cache-prior"), capacity=0.5) as p0:
        model(input_ids=ids)
        base_rate = p0.stats().miss_rate
    target = round(base_rate * 0.5, 4)
    with patch_model(model, RoutingConfig("cache-prior"), capacity=0.5) as patch:
        ctl = attach(patch, target)
        for c in range(0, 600, 100):  # chunked forward calls: the controller still sees every token
            model(input_ids=ids[:, c:c + 100])
        stats = patch.stats()
    assert sum(s.misses for s in stats.per_layer) == sum(x.misses for x in ctl.layers)
    assert stats.miss_rate == pytest.approx(ctl.miss_rate())
    assert stats.miss_rate == pytest.approx(target, rel=0.1)


def test_eval_cli_target_miss_rate(tmp_path, capsys):
    import json

    from expertcache.cli.main import main
    from expertcache.eval.synthetic import save_tiny_with_tokenizer, write_toy_data

    model = save_tiny_with_tokenizer("mixtral", tmp_path / "m")
    data = write_toy_data(tmp_path / "d")
    base = ["eval", "--model", str(model), "--task", "wikitext", "--data-dir", str(data), "--limit", "2",
            "--capacity", "4", "--no-progress"]
    assert main([*base, "--policy", "cache-prior", "--json"]) == 0
    orig = json.loads(capsys.readouterr().out)
    target = round(orig["miss_rate"] * 0.6, 4)
    assert main([*base, "--policy", "cache-prior", "--target-miss-rate", str(target), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["controller"]["target"] == target
    assert row["controller"]["miss_rate"] == pytest.approx(row["miss_rate"])
    assert row["miss_rate"] < orig["miss_rate"]
    # the same budget in bytes: B = X · K · L · bytes of one expert (as loaded)
    from expertcache.eval import load_model_and_tokenizer
    from expertcache.models import patch_model
    from expertcache.routing.budget import expert_bytes

    m, _ = load_model_and_tokenizer(str(model))
    with patch_model(m, RoutingConfig("cache-prior"), capacity=4) as p:
        per_token = target * p.top_k * len(p.layers) * expert_bytes(p)
        assert expert_bytes(p) == sum(q.numel() * q.element_size()
                                      for q in p.layers[0].block.experts.parameters()) // p.num_experts
    assert main([*base, "--policy", "cache-prior", "--target-bytes-per-token", str(per_token), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["controller"]["target"] == pytest.approx(target)
    for bad, match in ((["--policy", "cumsum", "--target-miss-rate", "0.1"], "cache-prior .*or eras-bias"),
                       (["--policy", "cache-prior", "--target-bytes-per-token", "1e15"], "miss rate of"),
                       (["--policy", "cache-prior", "--target-bytes-per-token", "5", "--target-miss-rate", "0.1"],
                        "not both"),
                       (["--policy", "cache-prior", "--target-miss-rate", "1.5"], r"\(0, 1\)"),
                       (["--policy", "cache-prior", "--calibrate-from", "x"], "needs --target-miss-rate"),
                       (["--policy", "cache-prior", "--target-miss-rate", "0.1", "--calibrate-from",
                         str(tmp_path / "none")], "calibrate-from")):
        assert main([*base, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()  # one error line (after the model load for bytes)
        assert err[-1].startswith("expertcache eval: error") and __import__("re").search(match, err[-1]), err


def test_open_loop_simulate_with_a_controller(tmp_path, capsys):
    from test_trace_sim import make_trace

    from expertcache.cli.main import main
    from expertcache.routing.budget import wrap
    from expertcache.sim import simulate

    torch.set_num_threads(1)
    trace = make_trace(t=1500, l=2, e=16, k=2, starts=[0])
    base = simulate(trace, RoutingConfig("cache-prior"), 4).miss_rate
    target = round(0.6 * base, 4)
    made = []
    res = simulate(trace, RoutingConfig("cache-prior"), 4,
                   router_hook=lambda r: made.append(wrap(r, target, trace.num_layers)) or made[-1])
    ctl = made[0].controller
    assert sum(s.misses for s in res.per_layer) == sum(x.misses for x in ctl.layers)
    assert res.miss_rate == pytest.approx(target, rel=0.1)
    path = str(trace.save(tmp_path / "t.trace"))
    assert main(["simulate", path, "--policy", "cache-prior", "--capacity", "4", "--target-miss-rate", str(target),
                 "--json"]) == 0
    row = __import__("json").loads(capsys.readouterr().out)
    assert row["controller"]["target"] == target and row["miss_rate"] == pytest.approx(res.miss_rate)
    assert main(["simulate", path, "--policy", "max-rank", "--target-miss-rate", "0.1"]) == 2
    assert main(["simulate", path, "--policy", "cache-prior", "--target-miss-rate", "0"]) == 2
