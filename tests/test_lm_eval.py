"""The lm-eval adapter (optional extra): request answers on the patched model, miss rates, offline task YAMLs."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from lm_eval.api.instance import Instance  # noqa: E402

from expertcache.integrations.lm_eval import ExpertCacheLM, write_local_tasks  # noqa: E402

from conftest import REPO, needs_shared_data  # noqa: E402
from conftest import SHARED_DATA as DATA  # noqa: E402

needs_data = needs_shared_data("mmlu", "gsm8k", "wikitext-2-raw-v1")

torch.set_num_threads(1)


def _req(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


@pytest.fixture(scope="module")
def lm_original():
    return ExpertCacheLM(pretrained="granular", policy="original", capacity=0.5)


def test_loglikelihood_equals_the_unpatched_model(lm_original):
    """policy=original returns the stock logits: the answer equals a plain forward pass of a fresh model."""
    from expertcache.eval import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("granular")
    ctx, cont = "The kernel schedules tasks", " on every CPU."
    (ll, greedy), = lm_original.loglikelihood([_req("loglikelihood", (ctx, cont))], disable_tqdm=True)
    ctx_ids = tok.encode(ctx, add_special_tokens=False)
    whole = tok.encode(ctx + cont, add_special_tokens=False)
    n = len(whole) - len(ctx_ids)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([whole[:-1]])).logits[0, -n:].float(), -1)
    want = float(logp.gather(1, torch.tensor(whole[-n:])[:, None]).sum())
    assert ll == pytest.approx(want, abs=1e-4)
    assert greedy == bool((logp.argmax(-1) == torch.tensor(whole[-n:])).all())
    rep = lm_original.miss_report()
    assert rep["tokens"] == len(whole) - 1 and 0.0 < rep["miss_rate"] <= 1.0
    assert set(rep["miss_rate_by_request"]) == {"loglikelihood"}


def test_rolling_and_generation_answer(lm_original):
    # a text shorter than the context is one window: the rolling score equals the loglikelihood of the text
    # after the prefix token (lm-eval's empty-context convention)
    text = "Debian is a free operating system."
    (total,) = lm_original.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))], disable_tqdm=True)
    (ll, _), = lm_original.loglikelihood([_req("loglikelihood", ("", text))], disable_tqdm=True)
    assert total < 0 and total == pytest.approx(ll, abs=1e-4)
    # a text over several windows: every token scored once, each window one forward call of ≤ max_length
    long = " ".join(["Linux"] * 700)
    n_tok = len(lm_original.tok_encode(long))
    assert n_tok > 2 * lm_original.max_length
    before = lm_original.miss_report()["tokens"]
    (total_long,) = lm_original.loglikelihood_rolling([_req("loglikelihood_rolling", (long,))], disable_tqdm=True)
    windows = -(-n_tok // lm_original.max_length)
    assert n_tok <= lm_original.miss_report()["tokens"] - before <= windows * lm_original.max_length
    assert total_long < total
    out, = lm_original.generate_until([_req("generate_until", ("Question: 2+2?\nAnswer:",
                                                               {"until": ["\n"], "max_gen_toks": 8}))],
                                      disable_tqdm=True)
    assert isinstance(out, str) and "\n" not in out
    assert "generate_until" in lm_original.miss_report()["miss_rate_by_request"]


def test_cache_prior_misses_less_than_original(lm_original):
    reqs = [_req("loglikelihood", ("The Python interpreter reads", " the source file and compiles it."))]
    strong = ExpertCacheLM(pretrained="granular", policy="cache-prior", lam="1.0", capacity="0.25")
    plain = ExpertCacheLM(pretrained="granular", policy="original", capacity="8")
    strong.loglikelihood(reqs, disable_tqdm=True)
    plain.loglikelihood(reqs, disable_tqdm=True)
    assert strong.patch.capacity == plain.patch.capacity == 8
    assert strong.miss_report()["miss_rate"] < plain.miss_report()["miss_rate"]


def test_target_miss_rate_model_arg():
    lm = ExpertCacheLM(pretrained="granular", policy="cache-prior", capacity="0.25", target_miss_rate="0.2")
    lm.loglikelihood_rolling([_req("loglikelihood_rolling", (" ".join(["Debian packages"] * 200),))],
                             disable_tqdm=True)
    rep = lm.miss_report()
    assert rep["policy"].startswith("cache-prior(target miss rate 0.2")
    assert rep["controller"]["target"] == 0.2 and rep["controller"]["miss_rate"] == pytest.approx(rep["miss_rate"])
    with pytest.raises(ValueError, match="cache-prior .*or eras-bias"):
        ExpertCacheLM(pretrained="granular", policy="cumsum", target_miss_rate="0.2")


@pytest.mark.parametrize("args, match", [
    (dict(policy="nope"), "unknown routing policy"),
    (dict(policy="cache-prior", lam="x"), "lam='x'"),
    (dict(policy="cache-prior", lam="2"), r"lam must be in \[0, 1\]"),
    (dict(wrong=1), "unknown option.*wrong"),
    (dict(batch_size="4"), "--batch_size 4"),
    (dict(policy="eras-bias", beta="1"), "freq_from"),
])
def test_bad_model_args(args, match):
    with pytest.raises(ValueError, match=match):
        ExpertCacheLM(pretrained="granular", **args)


def test_missing_checkpoint_names_pretrained(tmp_path):
    with pytest.raises(FileNotFoundError, match="pretrained=.*nope"):
        ExpertCacheLM(pretrained=str(tmp_path / "nope"))


@needs_data
def test_local_task_yamls(tmp_path):
    names = write_local_tasks(DATA, tmp_path)
    assert {"ec_mmlu_abstract_algebra", "ec_gsm8k", "ec_wikitext"} <= set(names)
    text = (tmp_path / "ec_mmlu_abstract_algebra.yaml").read_text()
    assert str((DATA / "mmlu" / "test" / "abstract_algebra_test.csv").resolve()) in text


@needs_data
@pytest.mark.slow
def test_simple_evaluate_offline_mmlu_gsm8k_wikitext(tmp_path, monkeypatch):
    """lm-eval's own evaluator over the local files, all three request types, nothing downloaded."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_local_tasks(DATA, tmp_path)
    lm = ExpertCacheLM(pretrained="granular", policy="cache-prior", lam=0.2, capacity=0.5)
    res = lm_eval.simple_evaluate(model=lm, tasks=["ec_mmlu_abstract_algebra", "ec_gsm8k", "ec_wikitext"],
                                  task_manager=TaskManager(include_path=str(tmp_path)), limit=2)
    r = res["results"]
    assert 0.0 <= r["ec_mmlu_abstract_algebra"]["acc,none"] <= 1.0
    assert "exact_match,strict-match" in r["ec_gsm8k"]
    assert r["ec_wikitext"]["word_perplexity,none"] > 1.0
    rep = lm.miss_report()
    assert set(rep["miss_rate_by_request"]) == {"loglikelihood", "generate_until", "loglikelihood_rolling"}
    assert 0.0 < rep["miss_rate"] < 1.0


@needs_data
@pytest.mark.slow
def test_launcher_command_line(tmp_path):
    write_local_tasks(DATA, tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "expertcache.integrations.lm_eval", "--model", "expertcache",
                        "--model_args", "pretrained=granular,policy=cache-prior,lam=0.2,capacity=0.5",
                        "--tasks", "ec_mmlu_abstract_algebra", "--include_path", str(tmp_path), "--limit", "2"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "ec_mmlu_abstract_algebra" in p.stdout
    assert "expertcache: cache-prior(lam=0.2,J=1) capacity=16: miss rate" in p.stderr


@pytest.mark.parametrize("argv, device", [(["--tasks", "x"], "auto"), (["--device", "cpu", "--tasks", "x"], "cpu"),
                                          (["--device=cuda:1"], "cuda:1")])
def test_launcher_defaults_the_device_to_auto(monkeypatch, argv, device):
    """lm-eval's config turns an absent ``--device`` into ``cuda:0``, which a machine without CUDA refuses: the
    launcher passes ``--device auto`` unless one is given (the slow launcher test failed on every CPU machine, unseen
    while CI never ran the slow tests)."""
    import lm_eval.__main__

    from expertcache.integrations import lm_eval as launcher

    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(list(sys.argv[1:])))
    monkeypatch.setattr(sys, "argv", ["prog"])
    assert launcher.main(argv) == 0
    got = seen[0]
    given = [a.split("=", 1)[1] for a in got if a.startswith("--device=")] + \
        [got[i + 1] for i, a in enumerate(got) if a == "--device"]
    assert given == [device], got
