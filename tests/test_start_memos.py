"""What a second start no longer does twice: the garbage collector paused while a command starts
(cli/gcpause.py), a safetensors header parsed once per process for an unchanged file (tensorfile.read_header)."""

from __future__ import annotations

import gc
import os
import struct

import pytest

from expertcache import tensorfile
from expertcache.cli.gcpause import GCPause, resume_gc


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from expertcache.models.tiny import save_tiny

    return save_tiny("olmoe", tmp_path_factory.mktemp("memos") / "tiny", seed=2)


@pytest.fixture
def gc_state():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()
    gc.unfreeze()


def test_a_pause_restores_the_collector_as_it_found_it(gc_state):
    gc.enable()
    with GCPause() as p:
        assert not gc.isenabled()
        with GCPause():  # inner: ends without enabling what the outer paused
            pass
        assert not gc.isenabled()
        p.resume()
        assert gc.isenabled()
        p.resume()  # idempotent
    assert gc.isenabled()
    gc.disable()
    with GCPause():
        pass
    assert not gc.isenabled()  # disabled on entry: stays disabled


def test_a_pause_ends_on_an_exception(gc_state):
    gc.enable()
    with pytest.raises(KeyError):
        with GCPause():
            raise KeyError("x")
    assert gc.isenabled()
    resume_gc()  # none active: nothing
    assert gc.isenabled()


def test_resume_gc_ends_the_innermost_and_freeze_moves_objects_out_of_scans(gc_state):
    gc.enable()
    gc.unfreeze()
    with GCPause(freeze=True):
        keep = [[i] for i in range(1000)]
        resume_gc()
        assert gc.isenabled() and gc.get_freeze_count() >= 1000
    del keep


def test_generate_keeps_the_collector_paused_until_its_first_token(tiny, monkeypatch, capsys, gc_state):
    """The CLI's `generate`: no collection can run while it loads the model (the collector disabled in
    from_pretrained), the collector is back before the second token, and enabled again after main returns."""
    from expertcache.cli.main import main
    from expertcache.offload import OffloadedModel
    from expertcache.offload import runtime as R

    gc.enable()
    seen = {}
    real = OffloadedModel.from_pretrained.__func__

    def from_pretrained(cls, *a, **k):
        seen["load"] = gc.isenabled()
        rt = real(cls, *a, **k)
        gen = rt.generate

        def generate(*a, on_token=None, **k):
            def tok(t):
                seen.setdefault("tokens", []).append(gc.isenabled())
                return on_token(t)
            return gen(*a, on_token=tok, **k)
        rt.generate = generate
        return rt

    monkeypatch.setattr(R.OffloadedModel, "from_pretrained", classmethod(from_pretrained))
    assert main(["generate", "--model", str(tiny), "--max-new-tokens", "3", "3 4 5"]) == 0
    assert seen["load"] is False
    assert seen["tokens"][0] is False and all(seen["tokens"][1:]) and len(seen["tokens"]) == 3
    assert gc.isenabled()


def _write_safetensors(path, names):
    import json

    header = {n: {"dtype": "U8", "shape": [4], "data_offsets": [4 * i, 4 * i + 4]} for i, n in enumerate(names)}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4 * len(names)))


def test_read_header_parses_an_unchanged_file_once(tmp_path, monkeypatch):
    f = tmp_path / "a.safetensors"
    _write_safetensors(f, ["x", "y"])
    parsed = []
    real = tensorfile._parse_header
    monkeypatch.setattr(tensorfile, "_parse_header", lambda *a: (parsed.append(1), real(*a))[1])
    first = tensorfile.read_header(f)
    first.pop("x")  # a caller's dict is its own
    assert sorted(tensorfile.read_header(f)) == ["x", "y"] and len(parsed) == 1
    _write_safetensors(f, ["z"])  # rewritten in place: another header
    assert sorted(tensorfile.read_header(f)) == ["z"] and len(parsed) == 2
    os.utime(f)  # touched: ctime moves, parsed again
    assert sorted(tensorfile.read_header(f)) == ["z"] and len(parsed) == 3
