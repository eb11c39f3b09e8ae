"""Issue 43 (round 4): inputs found by name or variable are inputs too, folders of the user's keep their files,
outputs that are not regular files are refused before the work, long output names, empty variables. Each case
failed (data loss, a hang, an error after the work) on main 0330290; the same in-process style as
tests/test_bad_inputs.py (whose fixtures it shares)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from expertcache.cli.main import build_parser, main
from expertcache.outputs import OutputError, check_args

import test_bad_inputs
from test_bad_inputs import SHIPPED, _check
from test_trace_sim import make_trace

env, one_thread = test_bad_inputs.env, test_bad_inputs.one_thread  # the shared fixtures
REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


def _digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _rule(argv) -> None:
    """The output rule alone for ``argv`` (parsed, nothing run): for inputs that must not be touched even when a
    test fails (the shipped model of the package under test)."""
    argv = [str(a) for a in argv]
    args = build_parser(argv[0]).parse_args(argv)
    check_args(args, args.command)


# -- data loss: inputs found by name or through a variable ----------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["trace", "record", "--model", "granular", "--task", "wikitext", "--out", SHIPPED / "model.safetensors"],
    ["trace", "record", "--model", "coarse", "--task", "wikitext", "--out", SHIPPED / "tokenizer.json"],
    ["sweep", "--model", "granular", "--trace", "x", "--out", SHIPPED / "card.json"],
    ["eval", "--model", "granular", "--task", "wikitext", "--out", SHIPPED / "config.json"],
], ids=["model-by-name", "other-shipped", "sweep", "eval-append"])
def test_shipped_models_by_name_are_inputs(argv, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no folder named granular here
    with pytest.raises(OutputError, match="input folder"):
        _rule(argv)


def test_data_found_through_a_flag_or_variable_is_an_input(env, capsys, monkeypatch, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(env["data"], data)
    rows = data / "wikitext-2-raw-v1" / "test.jsonl"
    before = _digest(rows)
    base = ["eval", "--model", "granular", "--task", "wikitext", "--limit", "1", "--no-progress"]
    _check([*base, "--data-dir", data, "--out", rows], "input folder", capsys)
    monkeypatch.setenv("EXPERTCACHE_DATA", str(data))
    _check([*base, "--out", rows], "input folder", capsys)
    _check(["trace", "record", "--model", "granular", "--task", "wikitext", "--out", rows], "input folder", capsys)
    assert _digest(rows) == before


def test_a_sidecar_in_the_cache_folder_is_an_input(env, monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    side = cache / "quant" / "granular-0123-expertcache-experts-v2-int8.safetensors"
    side.parent.mkdir(parents=True)
    side.write_bytes(b"sidecar")
    monkeypatch.setenv("EXPERTCACHE_CACHE", str(cache))
    with pytest.raises(OutputError, match="expert cache folder"):
        _rule(["trace", "record", "--model", env["tiny"], "--task", "wikitext", "--out", side])


# -- data loss: a folder of the user's keeps its files ------------------------------------------------------------


def _rows(path: Path) -> Path:
    rows = [{"kind": "sweep", "mode": "open-loop", "miss_rate": m, "quality": q,
             "config": {"routing": {"policy": p}, "capacity": 16, "eviction": "lru", "num_experts": 32},
             "trace": "t.trace", "quality_name": "router_mass", "sweep_key": f"{p}{m}"}
            for p, m, q in (("original", 0.5, 1.0), ("cache-prior", 0.3, 0.9))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_never_replaces_a_users_file_or_its_input(capsys, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    mine = notes / "pareto.md"
    mine.write_text("# my own Pareto notes\n")
    rows = _rows(tmp_path / "rows.jsonl")
    _check(["report", rows, "--out-dir", notes], "pareto.md", capsys)
    assert mine.read_text() == "# my own Pareto notes\n"
    assert sorted(p.name for p in notes.iterdir()) == ["pareto.md"]  # nothing half-written beside it
    # its own input, named like an output
    d = tmp_path / "d"
    d.mkdir()
    own = _rows(d / "pareto.md")
    before = _digest(own)
    _check(["report", own, "--out-dir", d], "pareto.md", capsys)
    assert _digest(own) == before
    # what report wrote itself, it may write again; a file changed since is the user's
    out = tmp_path / "figs"
    assert main(["report", str(rows), "--out-dir", str(out)]) == 0
    assert main(["report", str(rows), "--out-dir", str(out)]) == 0
    (out / "pareto.md").write_text("edited by hand\n")
    _check(["report", rows, "--out-dir", out], "pareto.md", capsys)
    assert (out / "pareto.md").read_text() == "edited by hand\n"
    capsys.readouterr()


def test_analyze_never_replaces_a_users_summary(env, capsys, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "analysis_summary.json").write_text('{"mine": true}\n')
    _check(["analyze", env["trace"], "--samples", "2", "--max-batch", "4", "--out-dir", notes],
           "analysis_summary.json", capsys)
    assert json.loads((notes / "analysis_summary.json").read_text()) == {"mine": True}
    out = tmp_path / "fig"
    for _ in range(2):  # its own files again: fine
        assert main(["analyze", env["trace"], "--samples", "2", "--max-batch", "4", "--out-dir", str(out)]) == 0
    capsys.readouterr()


def test_rows_are_never_appended_to_a_note(tmp_path):
    """bench_quant.py --out notes.md appended JSON rows to a Markdown file, after minutes of work; now refused
    before the work, by the script and by append_jsonl itself (every writer of rows)."""
    from expertcache.results import append_jsonl

    notes = tmp_path / "notes.md"
    notes.write_text("# results\n\nmy notes\n")
    with pytest.raises(ValueError, match="notes.md"):
        append_jsonl(notes, {"a": 1})
    for script, extra in (("bench_quant.py", ["--only", "kernel", "--repeats", "1"]),
                          ("bench_mixed.py", ["speed", "--fraction", "0.5"]), ("bench_serve.py", []),
                          ("bench_serve_hostile.py", []), ("bench_peers.py", ["run"]), ("bench_kernels.py", [])):
        r = subprocess.run([sys.executable, str(BENCH / script), *extra, "--out", str(notes)], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 2, (script, r.stderr[-2000:])
        assert "notes.md" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert notes.read_text() == "# results\n\nmy notes\n"


def test_no_benchmark_script_appends_rows_by_hand():
    """The class: every script's rows go through append_jsonl (the row-file check, whole rows), never a file
    opened for appending (bench_peers/bench_serve/bench_serve_hostile did)."""
    import re

    found = [f"{p.name}:{i}" for p in sorted(BENCH.glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"""open\([^)]*,\s*["']a[b+]?["']""", line)]
    assert not found, found


# -- hangs: an output that is a FIFO blocked forever after the work ----------------------------------------------


def _cli(*argv, timeout=120, **kw):
    """``expertcache ARGV`` in a fresh process (a hang is a TimeoutExpired, not a stuck test run)."""
    return subprocess.run([sys.executable, "-m", "expertcache.cli.main", *map(str, argv)], capture_output=True,
                          text=True, timeout=timeout, **kw)


def test_an_output_that_is_a_fifo_is_refused_before_the_work(env, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for argv, flag in ((["simulate", env["trace"], "--out", fifo], "--out"),
                       (["sweep", "--trace", env["trace"], "--policies", "original", "--out", fifo, "--no-progress"],
                        "--out"),
                       (["analyze", env["trace"], "--profile-out", fifo], "--profile-out"),
                       (["eval", "--model", "granular", "--task", "wikitext", "--data-dir", env["data"],
                         "--trace-out", fifo], "--trace-out"),
                       (["trace", "record", "--model", "granular", "--data-dir", env["data"], "--out", fifo],
                        "--out")):
        r = _cli(*argv, timeout=60)
        assert r.returncode == 2, (argv, r.stderr)
        assert f"{flag} {fifo}" in r.stderr and "FIFO" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_streams_take_no_lock_file_beside_them(env):
    """sweep --out /dev/null left /dev/null.lock (as root) and failed; --out /dev/stdout failed on a lock under
    /proc; ``-`` is stdout."""
    had_lock = os.path.exists("/dev/null.lock")
    r = _cli("sweep", "--trace", env["trace"], "--policies", "original", "--out", "/dev/null", "--no-progress")
    try:
        assert r.returncode == 0, r.stderr
        assert had_lock or not os.path.exists("/dev/null.lock")
    finally:
        if not had_lock and os.path.exists("/dev/null.lock"):
            os.unlink("/dev/null.lock")
    for out in ("/dev/stdout", "-"):
        r = _cli("sweep", "--trace", env["trace"], "--policies", "original", "--out", out, "--no-progress")
        assert r.returncode == 0, r.stderr
        rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        assert rows and all("miss_rate" in row for row in rows), r.stdout[-500:]
    assert not Path("-").exists()


# -- unclear: a valid long output name, an empty variable ---------------------------------------------------------


def test_an_output_name_at_the_limit_is_written(env, capsys, tmp_path):
    """The temporary name (``.<name>.XXXXXXXX.tmp``) was longer than the output's and failed after the work."""
    name = "p" * (255 - len(".npy")) + ".npy"
    assert main(["analyze", env["trace"], "--samples", "2", "--max-batch", "4", "--profile-out",
                 str(tmp_path / name)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == [name]
    _check(["analyze", env["trace"], "--profile-out", tmp_path / ("q" * 300 + ".npy")], "--profile-out", capsys)
    from expertcache.outputs import TMP_SUFFIX, temp_file

    tmp = temp_file(tmp_path / name)
    assert tmp.name.endswith(TMP_SUFFIX) and len(tmp.name) <= 255
    capsys.readouterr()


def test_an_empty_variable_is_unset_not_the_current_folder(monkeypatch, tmp_path):
    from expertcache.offload.loader import cache_dir
    from expertcache.train.data import data_root

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EXPERTCACHE_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "expertcache"
    monkeypatch.setenv("EXPERTCACHE_DATA", "  ")
    assert data_root() != Path("  ") and data_root().name == "data"


# -- silently wrong: a sidecar is bound to the checkpoint it was made from ---------------------------------------


def _gen(model, *extra):
    return ["generate", "--model", str(model), "--quant", "int8", "--io", "cached", "--max-new-tokens", "6",
            "--temperature", "0", *extra, "1 2 3"]


def test_a_sidecar_copied_from_another_model_is_not_used(capsys, tmp_path, monkeypatch):
    """granular's sidecar copied into another model of the same shape was used: --quant int8 --model M generated
    granular's text."""
    from expertcache.models.tiny import save_tiny
    from expertcache.offload import store

    monkeypatch.setattr(store, "_VERIFIED", set())
    a, b = save_tiny("olmoe", tmp_path / "a", seed=1), save_tiny("olmoe", tmp_path / "b", seed=2)
    assert main(_gen(a)) == 0
    text_a = capsys.readouterr().out
    assert main(_gen(b)) == 0
    text_b = capsys.readouterr().out
    assert text_a != text_b  # two different models
    side_a = next(p for p in (tmp_path / "cache" / "quant").glob("a-*.safetensors"))
    for p in (tmp_path / "cache" / "quant").glob("b-*"):
        p.unlink()  # B's own sidecar gone: only A's copy beside B remains
    shutil.copy(side_a, b / side_a.name.split("-", 2)[-1])
    assert main(_gen(b)) == 0
    cap = capsys.readouterr()
    assert cap.out == text_b, "the copied sidecar of model a was used for model b"
    notes = [line for line in cap.err.splitlines() if "another checkpoint" in line]
    assert len(notes) == 1 and str(b / side_a.name.split("-", 2)[-1]) in notes[0], cap.err
    # the same copy in the cache folder's place of B's sidecar: rebuilt, one line
    side_b = next(p for p in (tmp_path / "cache" / "quant").glob("b-*.safetensors"))
    (b / side_a.name.split("-", 2)[-1]).unlink()
    shutil.copy(side_a, side_b)
    store._VERIFIED.clear()
    assert main(_gen(b)) == 0
    cap = capsys.readouterr()
    assert cap.out == text_b
    assert len([x for x in cap.err.splitlines() if "another checkpoint" in x and "rebuilding" in x]) == 1, cap.err


def test_sidecar_format_and_place_are_named_right(capsys, tmp_path, monkeypatch):
    """A newer format was called "older" and rebuilt over; a folder in the sidecar's place was reported as the
    temporary file's error."""
    from expertcache.models.tiny import save_tiny
    from expertcache.offload import store
    from expertcache.offload.checkpoint import CheckpointError

    monkeypatch.setattr(store, "_VERIFIED", set())
    m = save_tiny("olmoe", tmp_path / "m", seed=1)
    assert main(_gen(m)) == 0
    capsys.readouterr()
    side = next((tmp_path / "cache" / "quant").glob("m-*.safetensors"))
    raw = side.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    meta = dict(header["__metadata__"])
    header["__metadata__"]["format_version"] = "9"
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new)) if len(new) <= n else b""
    assert len(new) == n
    side.write_bytes(raw[:8] + new + raw[8 + n:])
    import torch

    layout = store.QuantLayout(meta["mode"], int(meta["d"]), int(meta["f"]), int(meta["group"]),
                               getattr(torch, meta["dtype"]), meta["kernel"])
    with pytest.raises(CheckpointError, match="newer expertcache") as exc:
        store.check_sidecar_layout(side, layout)
    assert "older" not in str(exc.value)
    newer = side.read_bytes()
    line = _check(_gen(m), "newer expertcache", capsys)  # not rebuilt over
    assert "older" not in line and side.read_bytes() == newer
    side.unlink()
    side.mkdir()
    _check(_gen(m), f"{side}: is a folder", capsys)


# -- silently wrong: flags that need another; traces of another model ---------------------------------------------


@pytest.mark.parametrize("flags, culprit", [
    (["--low-cost", "0.5"], "--low-cost"),
    (["--promote-after", "3"], "--promote-after"),
    (["--low-cost", "0"], "--low-cost"),  # 0 is a price too
    (["--low-threshold", "0.1", "--promote-after", "2"], "--promote-after"),
])
def test_low_precision_rule_flags_need_resident_quant(env, capsys, flags, culprit):
    """--low-cost and --promote-after without --resident-quant were accepted and did nothing."""
    line = _check(["generate", "--model", env["tiny"], *flags, "--max-new-tokens", "2", "1 2"], culprit, capsys)
    assert "--resident-quant" in line


def test_a_trace_of_another_model_is_refused(env, capsys, tmp_path):
    """eval --calibrate-from a trace of an N = 8 model given to granular (N = 32) was accepted (and back)."""
    small = env["trace"]  # N = 8, K = 2, 3 layers
    base = ["eval", "--model", "granular", "--task", "wikitext", "--data-dir", env["data"], "--limit", "1",
            "--capacity", "16", "--no-progress"]
    line = _check([*base, "--policy", "cache-prior", "--target-miss-rate", "0.3", "--calibrate-from", small],
                  "--calibrate-from", capsys)
    assert "N = 8" in line and "32" in line, line
    _check([*base, "--policy", "eras-bias", "--freq-from", small], "--freq-from", capsys)
    # and back: granular's own trace given to the tiny N = 8 model
    own = tmp_path / "granular.trace"
    assert main(["trace", "record", "--model", "granular", "--task", "wikitext", "--data-dir", env["data"],
                 "--tokens", "64", "--out", str(own)]) == 0
    capsys.readouterr()
    _check(["eval", "--model", env["tiny"], "--task", "wikitext", "--data-dir", env["data"], "--limit", "1",
            "--capacity", "4", "--policy", "eras-bias", "--freq-from", own, "--no-progress"], "--freq-from", capsys)
    # its own trace: accepted
    assert main([*base, "--policy", "eras-bias", "--freq-from", str(own), "--json"]) == 0
    capsys.readouterr()


def test_generate_offers_only_policies_it_can_run(env, capsys):
    """generate --policy eras-bias was offered but could not run (it needs a profile no flag passes)."""
    line = _check(["generate", "--model", env["tiny"], "--policy", "eras-bias", "1 2"], "--policy", capsys)
    assert "eras-bias" in line
    assert main(["generate", "--help"]) == 0
    assert "eras-bias" not in capsys.readouterr().out.split("--policy")[1].split("--")[0]


# -- tracebacks and silently wrong rows of the benchmark scripts -------------------------------------------------


@pytest.mark.parametrize("script, argv, culprit", [
    ("bench_quant.py", ["--only", "kernel", "--repeats", "0"], "--repeats"),
    ("bench_mixed.py", ["speed", "--fraction", "0"], "--fraction"),  # rows with a negative memory
    ("bench_mixed.py", ["speed-one"], "speed-one"),
])
def test_benchmark_flags_are_one_line(script, argv, culprit, tmp_path):
    out = tmp_path / "rows.jsonl"
    r = subprocess.run([sys.executable, str(BENCH / script), *argv, "--out", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and culprit in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert not out.exists()


# -- hangs: a chat template that loops ------------------------------------------------------------------------


def test_a_looping_chat_template_is_stopped():
    """A model's chat template that loops never answered and burnt a core after the client left."""
    import threading
    import time

    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer

    from expertcache.serve.app import render_chat

    tok = AutoTokenizer.from_pretrained(SHIPPED)
    msgs = [{"role": "user", "content": "hi"}]
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert render_chat(msgs, tok) == ("user: hi\n", False)  # an ordinary template: rendered as before
    tok.chat_template = ("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
                         "{{ messages[0]['content'] }}")
    got = {}

    def go():
        t0 = time.monotonic()
        try:
            got["text"] = render_chat(msgs, tok)
        except TemplateError as exc:
            got["error"] = exc
        got["s"] = time.monotonic() - t0

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the looping template was not stopped"
    assert "error" in got and "chat template ran past" in str(got["error"]) and got["s"] < 10, got


# -- crash: every command imports torch, so every command checks the memory floor ---------------------------------


@pytest.mark.parametrize("command", ["simulate", "analyze", "report", "trace"])
def test_every_command_checks_the_memory_floor(env, command, tmp_path):
    """simulate in a 100 MB cgroup was OOM-killed without a word (the check covered the model commands only)."""
    root = tmp_path / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("0::/job\n")
    (root / "sys/fs/cgroup/job").mkdir(parents=True)
    (root / "sys/fs/cgroup/job/memory.max").write_text(str(100 * 2**20) + "\n")
    argv = {"simulate": [command, env["trace"]], "analyze": [command, env["trace"]],
            "report": [command, "--out-dir", str(tmp_path / "r")], "trace": [command, "info", env["trace"]]}[command]
    code = (f"import sys; from expertcache.cli.main import main; rc = main({argv!r}); "
            "print('RC', rc, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, EXPERTCACHE_CGROUP_ROOT=str(root)))
    assert "RC 2 False" in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [
        f"expertcache {command}: error: the memory cgroup allows 100 MiB, less than the 384 MiB this process needs "
        + ("before it can load a model (Python, torch, transformers)" if command == "trace" else
           "before it can start (Python, torch)") + "; give the cgroup more memory"]


# -- tracebacks: --compile with a compiler that does not work -------------------------------------------------------


def test_compile_with_a_compiler_that_does_not_work_is_one_line(env, capsys, monkeypatch):
    """CXX=/bin/false passed the up-front check (found on PATH), then an inductor traceback minutes later."""
    from expertcache.models import captured

    monkeypatch.setattr(captured, "_COMPILER_OK", {}, raising=False)
    monkeypatch.setenv("CXX", "/bin/false")
    line = _check(["generate", "--model", env["tiny"], "--compile", "--max-new-tokens", "2", "1 2"], "--compile",
                  capsys)
    assert "/bin/false" in line and "CXX" in line


def test_compile_with_no_room_for_its_code_is_one_line(env, capsys, monkeypatch, tmp_path):
    """A full (here: unwritable) $TMPDIR under --compile: a traceback after the work began."""
    from expertcache.models import captured

    if os.geteuid() == 0:  # root writes anywhere: point the compile cache at a file instead of a folder
        blocker = tmp_path / "file"
        blocker.write_text("x")
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker / "sub"))
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(ro))
    monkeypatch.setattr(captured, "_COMPILER_OK", {})
    line = _check(["generate", "--model", env["tiny"], "--compile", "--max-new-tokens", "2", "1 2"], "--compile",
                  capsys)
    assert "TORCHINDUCTOR_CACHE_DIR" in line


# -- tracebacks / stumbles: PYTHONWARNINGS=error, transformers' cache argument ------------------------------------


def test_the_cache_argument_is_transformers_current_name():
    """transformers 5.24 renamed past_key_values to cache (the old name warns twice, and raises under
    PYTHONWARNINGS=error): every call passes the name this transformers' model forward declares."""
    import inspect

    from transformers import MixtralForCausalLM, OlmoeForCausalLM

    from expertcache.models.cachearg import cache_kw

    (name,) = cache_kw(None)
    for cls in (OlmoeForCausalLM, MixtralForCausalLM):
        assert name in inspect.signature(cls.forward).parameters


def test_model_commands_run_under_pythonwarnings_error(env, tmp_path):
    """bench printed 'Exception ignored ... ResourceWarning' three times (an unclosed /proc/cpuinfo); under
    transformers 5.24 every model command died in its deprecation warning."""
    run_env = dict(os.environ, PYTHONWARNINGS="error", EXPERTCACHE_CACHE=str(tmp_path / "cache"))
    for argv in (["generate", "--max-new-tokens", "3", "The kernel"],
                 ["bench", "--model", env["tiny"], "--tokens", "4", "--policies", "cache-prior"]):
        r = _cli(*argv, timeout=600, env=run_env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Warning" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]


# -- unclear: a tokenizer that produces no tokens --------------------------------------------------------------


def test_a_tokenizer_that_produces_no_tokens_is_named(capsys, tmp_path):
    """It led to "empty prompt" (and, in serve, to 400s blaming the user's message)."""
    model = tmp_path / "zerotok"
    shutil.copytree(SHIPPED, model)
    t = json.loads((model / "tokenizer.json").read_text())
    t["normalizer"] = {"type": "Replace", "pattern": {"Regex": "[\\s\\S]"}, "content": ""}  # deletes every character
    (model / "tokenizer.json").write_text(json.dumps(t))
    line = _check(["generate", "--model", model, "--max-new-tokens", "2", "The kernel"], "tokenizer.json", capsys)
    assert "produces no tokens" in line and "empty prompt" not in line
    r = _cli("serve", "--model", model, "--port", "0", timeout=120)  # (it served, and 400'd every request)
    assert r.returncode == 2 and "tokenizer.json" in r.stderr and "produces no tokens" in r.stderr, r.stderr
    from expertcache.models.loader import no_tokens_message

    assert no_tokens_message("  ") == "empty prompt"
    assert "tokenizer" in no_tokens_message("text the tokenizer drops")


# -- newcomer stumbles: README's commands demonstrate what they claim; the set-up line installs the tested set -----


def _table_commands() -> list[str]:
    import re

    text = (REPO / "README.md").read_text()
    return [c for line in text.splitlines() if line.startswith("|")
            for c in re.findall(r"`(expertcache generate [^`]*)`", line)]


@pytest.mark.parametrize("flag, shows", [("--host-memory", lambda r: r["tiers"]["host_hits"] > 0),
                                         ("--resident-quant", lambda r: r["low_computes"] > 0)])
def test_readme_feature_commands_demonstrate_their_feature(flag, shows, tmp_path):
    """`--resident-quant int4 --low-threshold 0.05 --policy cache-prior` ran at C = N with λ = 0 (nothing computed
    at 4 bits); `--host-memory 6MiB --policy cache-prior-cost` read 0 bytes from host RAM."""
    import shlex

    (cmd,) = [c for c in _table_commands() if flag in c]
    argv = shlex.split(cmd)[1:]
    r = _cli(*argv[:-1], "--max-new-tokens", "16", "--json", argv[-1], timeout=600,
             env=dict(os.environ, EXPERTCACHE_CACHE=str(tmp_path / "cache")))
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stderr.strip().splitlines()[-1])
    assert shows(row), (cmd, {k: row.get(k) for k in ("tiers", "low_computes", "misses", "hit_rate")})


def test_the_setup_line_installs_the_tested_versions():
    """The set-up line installed transformers 5.24 while 5.23 was tested."""
    first = next(line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("pip install"))
    assert "-c requirements-ci.txt" in first
    pins = (REPO / "requirements-ci.txt").read_text()
    assert "transformers==" in pins and "torch==" in pins


def test_a_run_folder_is_never_a_users_folder(capsys, tmp_path):
    """train --out / melinoe finetune --out wrote log.jsonl (truncated: open "w"), checkpoints and data caches into
    any folder; only its model/ sub-folder was checked."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "docs.jsonl").write_text("".join(json.dumps({"source": f"d{i}", "text": "The kernel loads. " * 40})
                                               + "\n" for i in range(8)))
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "log.jsonl").write_text('{"my": "own log"}\n')
    _check(["train", "--out", notes, "--data-dir", corpus, "--steps", "1"], "--out", capsys)
    _check(["melinoe", "finetune", "--model", "granular", "--out", notes, "--data-dir", corpus], "--out", capsys)
    assert (notes / "log.jsonl").read_text() == '{"my": "own log"}\n'
    assert sorted(p.name for p in notes.iterdir()) == ["log.jsonl"]
    from expertcache.outputs import MARK, claim_run_folder

    run = claim_run_folder(tmp_path / "run", "--out", "train")  # a new folder: created and marked, then reusable
    assert (run / MARK).is_file() and claim_run_folder(run, "--out", "train") == run
    with pytest.raises(OutputError):
        claim_run_folder(run, "--out", "melinoe finetune")


def test_a_hub_models_local_copy_is_an_input(monkeypatch, tmp_path):
    hub = tmp_path / "hub"
    snap = hub / "models--owner--moe" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(b"weights")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputError, match="hub cache"):
        _rule(["trace", "record", "--model", "owner/moe", "--task", "wikitext", "--out", snap / "model.safetensors"])


@pytest.mark.parametrize("script, args, culprit", [
    ("bench_kernels.py", ["--rounds", "0"], "--rounds"),
    ("bench_quant.py", ["--only", "kl", "--kl-chunks", "0"], "--kl-chunks"),
    ("bench_quant.py", ["--only", "kl", "--models", "nosuch"], "nosuch"),
])
def test_new_benchmark_flags_are_checked_before_the_work(script, args, culprit):
    """bench_kernels --rounds 0, bench_quant --kl-chunks 0 and a missing --models gave tracebacks (after the set-up)."""
    r = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert culprit in r.stderr and "Traceback" not in r.stderr, r.stderr
