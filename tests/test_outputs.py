"""The output rule (``expertcache.outputs``): no command damages a file or folder of the user's.

Each case runs the CLI in-process and checks that the user's bytes are unchanged afterwards and that the answer is
one error line naming the flag, exit 2 -- before any model loads. Issue 32's data-loss cases: the trace appended to
(simulate) or truncated (sweep), a text file's last line cut (sweep), a text replaced by a trace (trace record), a
model replaced by its table or a user's folder deleted (mole export), a user's model folder's config.json rewritten
(bench --make-model --out-dir).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import SHARED_DATA
from expertcache.cli.main import main
from expertcache.outputs import (MARK, TMP_SUFFIX, OutputError, check_row_file, publish_folder, temp_folder)

from test_trace_sim import make_trace

SHIPPED = Path(__file__).resolve().parents[1] / "src" / "expertcache" / "assets" / "models" / "granular"


def _snapshot(path: Path) -> dict:
    """Every file under ``path`` (or the file itself) with a digest of its bytes."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path) if p != path else p.name): hashlib.sha1(p.read_bytes()).hexdigest() for p in files}


def _refused(argv, culprit, capsys) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert code == 2, (code, err)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and culprit in lines[0], err
    return lines[0]


def _tiny_mole(folder: Path) -> Path:
    """A real (random, tiny) training-form MoLE model folder: what `mole export` reads."""
    import torch

    from expertcache.mole.modeling import MoleConfig, MoleForCausalLM

    cfg = MoleConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, num_experts=2, expert_intermediate_size=8)
    torch.manual_seed(0)
    MoleForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.fixture
def files(tmp_path):
    f = {"root": tmp_path}
    f["trace"] = Path(make_trace(t=60).save(tmp_path / "t.trace"))
    f["notes"] = tmp_path / "notes.txt"
    f["notes"].write_text("The kernel loads the module and the scheduler runs it.\n" * 120 + "no final newline")
    f["model"] = _tiny_mole(tmp_path / "mymodel")
    f["granular"] = Path(shutil.copytree(SHIPPED, tmp_path / "granular"))
    mine = tmp_path / "my-folder"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work\n")
    f["mine"] = mine
    return f


def _cases(f):
    t, notes, model, mine, root = f["trace"], f["notes"], f["model"], f["mine"], f["root"]
    link = root / "link.trace"
    link.symlink_to(t)
    hard = root / "hard.trace"
    os.link(t, hard)
    return [
        # the output is the input, by name, link, '..' or hard link
        ("simulate T --out T", ["simulate", t, "--out", t], "is the input", t),
        ("simulate T --out link", ["simulate", t, "--out", link], "is the input", t),
        ("simulate T --out ../T", ["simulate", t, "--out", root / "sub" / ".." / "t.trace"], "is the input", t),
        ("simulate T --out hardlink", ["simulate", t, "--out", hard], "is the input", t),
        ("sweep --trace T --out T", ["sweep", "--trace", t, "--policies", "original", "--out", t, "--no-progress"],
         "is the input", t),
        ("analyze T --profile-out T", ["analyze", t, "--profile-out", t], "is the input", t),
        ("trace record --file X --out X", ["trace", "record", "--task", "text-file", "--file", notes, "--out", notes],
         "is the input", notes),
        ("mole export M --out M", ["mole", "export", model, "--out", model], "is the input", model),
        ("trace record --model M --out M/model.safetensors", ["trace", "record", "--model", f["granular"], "--out",
                                                              f["granular"] / "model.safetensors"],
         "file of the input folder", f["granular"]),
        ("mole export M --out parent", ["mole", "export", model, "--out", root], "holds the input", root),
        # appending rows to a file that is not a row file
        ("sweep --out notes.txt", ["sweep", "--trace", t, "--policies", "original", "--out", notes, "--no-progress"],
         "not a file of JSON rows", notes),
        ("simulate --out notes.txt", ["simulate", t, "--out", notes], "not a file of JSON rows", notes),
        ("simulate --out other trace", ["simulate", t, "--out", root / "copy.trace"], "not a file of JSON rows",
         root / "copy.trace"),
        # replacing a folder this command did not write
        ("mole export --out user folder", ["mole", "export", model, "--out", mine], "not one this command wrote",
         mine),
        ("mole export --out .", ["mole", "export", model, "--out", "."], "--out", root),
        ("bench --make-model --out-dir user model", ["bench", "--make-model", "olmoe-1b-7b", "--layers", "1",
                                                     "--out-dir", model], "not one this command wrote", model),
        ("train --out folder holding a user's model/", ["train", "--model", "tiny", "--out", root / "run",
                                                       "--steps", "1", "--no-progress"], "not one this command wrote",
         root / "run"),
        ("melinoe finetune --out folder holding a user's model/", ["melinoe", "finetune", "--out", root / "run",
                                                                  "--steps", "1"], "not one this command wrote",
         root / "run"),
    ]




def _check_cases(files, capsys, monkeypatch, melinoe: bool) -> int:
    monkeypatch.chdir(files["root"])
    (files["root"] / "copy.trace").write_bytes(files["trace"].read_bytes())
    user_model = files["root"] / "run" / "model"
    user_model.mkdir(parents=True)
    (user_model / "weights.safetensors").write_bytes(b"mine")
    n = 0
    for name, argv, culprit, guarded in _cases(files):
        if (argv[0] == "melinoe") != melinoe:
            continue
        n += 1
        before = _snapshot(guarded)
        line = _refused(argv, culprit, capsys)
        assert "--out" in line or "--profile-out" in line, (name, line)
        assert _snapshot(guarded) == before, name
    assert not list(files["root"].rglob(f"*{TMP_SUFFIX}"))
    return n


def test_no_output_damages_an_input_or_a_users_file(files, capsys, monkeypatch):
    assert _check_cases(files, capsys, monkeypatch, melinoe=False) > 10


def test_melinoe_finetune_output_does_not_damage_a_users_folder(files, capsys, monkeypatch):
    """Apart so that its skip shows: ``melinoe finetune`` reads the training corpus before its output folder."""
    if not (SHARED_DATA / "corpus-debian-docs").is_dir():
        pytest.skip(f"melinoe finetune reads the training corpus first: {SHARED_DATA / 'corpus-debian-docs'} "
                    "is absent")
    assert _check_cases(files, capsys, monkeypatch, melinoe=True) >= 1


def test_a_row_file_with_a_torn_last_row_still_resumes(files, capsys):
    """The rule refuses other files, not an interrupted sweep's own: its torn row is cut and the run resumes."""
    out = files["root"] / "rows.jsonl"
    argv = ["sweep", "--trace", str(files["trace"]), "--policies", "original,cache-prior", "--strengths", "0.5",
            "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    whole = out.read_text().splitlines()
    assert len(whole) == 2
    out.write_text(whole[0] + "\n" + whole[1][: len(whole[1]) // 2])  # torn second row
    assert main(argv) == 0
    again = out.read_text().splitlines()
    assert len(again) == 2 and [json.loads(x)["sweep_key"] for x in again] == [json.loads(x)["sweep_key"]
                                                                             for x in whole]
    capsys.readouterr()


@pytest.mark.parametrize("text, ok", [("", True), ('{"a": 1}\n', True), ('{"a": 1}\n{"b": 2', True),
                                      ('{"a": 1}\n\n{"b": 2}\n', True), ("plain text\n", False),
                                      ('{"a": 1}\n[1, 2]\n', False), ('{"a": 1}\nlast line', False),
                                      ('{"a": 1', False), ("caf\xe9", False)])
def test_check_row_file(tmp_path, text, ok):
    p = tmp_path / "rows.jsonl"
    p.write_bytes(text.encode("latin-1"))
    before = p.read_bytes()
    if ok:
        check_row_file(p, "--out")
    else:
        with pytest.raises(OutputError, match="--out .*not a file of JSON rows"):
            check_row_file(p, "--out")
    assert p.read_bytes() == before


def test_publish_folder_replaces_only_its_own_folders(tmp_path):
    final = tmp_path / "table"
    tmp = temp_folder(final)
    assert tmp.name.endswith(TMP_SUFFIX) and tmp.parent == tmp_path
    (tmp / "a.bin").write_bytes(b"1")
    publish_folder(tmp, final, "mole export")
    assert (final / "a.bin").read_bytes() == b"1" and json.loads((final / MARK).read_text())["command"] == "mole export"
    tmp = temp_folder(final)
    (tmp / "b.bin").write_bytes(b"2")
    publish_folder(tmp, final, "mole export")  # its own folder: replaced
    assert sorted(p.name for p in final.iterdir()) == sorted([MARK, "b.bin"])
    tmp = temp_folder(final)
    with pytest.raises(OutputError, match="written by `expertcache mole export`"):
        publish_folder(tmp, final, "train")  # another command's folder
    assert (final / "b.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["table", tmp.name])


def test_a_failed_safetensors_write_names_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    """A full disk while writing a quant sidecar or a --make-model checkpoint said 'stdout: No space left on
    device' and left a 1-64 MB .tmp behind."""
    import torch

    import expertcache.offload.writer as writer

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer.os, "fsync", full)
    path = tmp_path / "sidecar.safetensors"
    with pytest.raises(OSError) as exc:
        writer.write_safetensors(path, [("w", torch.float32, (4, 4), lambda: torch.zeros(4, 4))])
    assert exc.value.errno == errno.ENOSPC and exc.value.filename == str(path)
    assert list(tmp_path.iterdir()) == []
