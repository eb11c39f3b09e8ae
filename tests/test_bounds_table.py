"""Every bounded input at its bound and its neighbours: bound - 1 (refused), the bound (taken), bound + 1.

- **Command-line flags**: every flag of every command whose argparse type has a bound is found by walking the
  parser (a new bounded flag joins the table by itself; one with an ``int_in`` range must be listed in
  :data:`INT_RANGES`, or the coverage test fails). The bound comes from the contract of the type (``positive_int``
  ≥ 1, ``unit_float`` in [0, 1], ...), each flag's type is tried at the bound and its neighbours, and the
  out-of-range value through ``expertcache`` itself: exit 2, one line naming the flag.
- **Routing strengths** (RoutingConfig's ranges: the flags ``--p`` ... ``--beta`` are plain floats checked by
  the config), the cgroup reader's "no limit" threshold and the import floor.
- **The JSON depth limit**: a document nested exactly ``MAX_DEPTH`` deep with one more bracket elsewhere (so
  the cheap count of brackets exceeds the limit and the real depth comparison runs), and one level deeper.
- **Server request fields** (``/v1/completions``): ``max_tokens`` at the room the context leaves, ``top_p`` and
  ``temperature`` at their ends, four stop strings, a prompt of exactly ``--max-prompt-tokens`` tokens, a body of
  exactly ``--max-request-bytes`` bytes, a body nested exactly as deep as the JSON limit -- each with its neighbours.

Surviving mutants of this file's own set: ``max_tokens > room`` as ``>= room`` (a request of exactly the room
the context leaves would decode hundreds of tokens here: only room + 1 is sent).
"""

from __future__ import annotations

import argparse
import json
import math

import pytest

from expertcache.cli import common
from expertcache.cli.main import build_parser, main
from expertcache.container import IMPORT_FLOOR, check_import_floor, cgroup_memory_limit
from expertcache.jsonsafe import MAX_DEPTH, JSONError, loads
from expertcache.routing import RoutingConfig

# -- command-line flags ----------------------------------------------------------------------------

#: ranges of the flags typed ``int_in(lo, hi)``, by (command, flag): the contract of each flag's help
INT_RANGES = {
    ("analyze", "--samples"): (1, 100_000),
    ("sweep", "--grid"): (1, 10_000),
    ("bench", "--tokens"): (2, 1 << 20),
    ("bench", "--batch"): (1, 1024),
    **{(cmd, "--readers"): (0, common.MAX_READERS) for cmd in ("generate", "bench", "serve")},
}
SEED = (0, 2**32 - 1)  # numpy's legacy seeding takes 32 bits
THREADS = (1, common.THREADS_PER_CORE * __import__("os").cpu_count())

#: (lo, hi, lo_open) of each named type, from its docstring; None: no bound on that side
TYPE_BOUNDS = {"positive_int": (1, None, False), "nonneg_int": (0, None, False),
               "nonneg_float": (0.0, None, False), "positive_float": (0.0, None, True),
               "unit_float": (0.0, 1.0, False), "_threads_type": (*THREADS, False)}


def _walk(parser, path=()):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                yield from _walk(sp, path + (name,))
        elif a.option_strings and a.type is not None:
            yield " ".join(path), a.option_strings[-1], a


def _is_int_in(t) -> bool:
    return getattr(t, "__qualname__", "") == "int_in.<locals>.parse"


def _bounded():
    """(command, flag, action, (lo, hi, lo_open), integer) of every flag whose type has a numeric bound."""
    out = []
    for cmd, flag, a in _walk(build_parser()):
        name = getattr(a.type, "__name__", "")
        if _is_int_in(a.type):
            cells = dict(zip(a.type.__code__.co_freevars, (c.cell_contents for c in a.type.__closure__)))
            key = (cmd, flag)
            rng = SEED if cells["hi"] == SEED[1] and cells["lo"] == 0 else INT_RANGES.get(key)
            out.append((cmd, flag, a, (*rng, False) if rng else None, True))
        elif name in TYPE_BOUNDS:
            out.append((cmd, flag, a, TYPE_BOUNDS[name], name.endswith("int") or name == "_threads_type"))
    return out


BOUNDED = _bounded()


def test_every_ranged_flag_is_in_the_table():
    missing = [(cmd, flag) for cmd, flag, _, b, _ in BOUNDED if b is None]
    assert not missing, f"int_in flags without an entry in INT_RANGES: {missing}"
    assert len(BOUNDED) > 60  # the walk found the commands' flags (not an empty parser)


def _below(x, integer):
    return x - 1 if integer else math.nextafter(x, -math.inf)


def _above(x, integer):
    return x + 1 if integer else math.nextafter(x, math.inf)


def _cases(lo, hi, lo_open, integer):
    """(value, taken) at each bound and its neighbours."""
    cases = []
    if lo is not None:
        cases += [(_below(lo, integer), False), (lo, not lo_open), (_above(lo, integer), True)]
    if hi is not None:
        cases += [(_below(hi, integer), True), (hi, True), (_above(hi, integer), False)]
    return cases


def _text(v, integer) -> str:
    return str(int(v)) if integer else repr(float(v))


@pytest.mark.parametrize("cmd,flag,action,bounds,integer", BOUNDED,
                         ids=[f"{c}{f}" for c, f, *_ in BOUNDED])
def test_each_bounded_flag_at_its_bound_and_neighbours(cmd, flag, action, bounds, integer):
    lo, hi, lo_open = bounds
    for value, taken in _cases(lo, hi, lo_open, integer):
        text = _text(value, integer)
        if taken:
            got = action.type(text)
            assert float(got) == float(value), (flag, text, got)
        else:
            with pytest.raises(argparse.ArgumentTypeError):
                action.type(text)


# out of range through the command line itself: one line naming the flag, exit 2 (one flag per type and command)
_E2E = {}
for _cmd, _flag, _a, _b, _int in BOUNDED:
    _E2E.setdefault((_cmd, getattr(_a.type, "__name__", ""), _b), (_cmd, _flag, _b, _int))


@pytest.mark.parametrize("cmd,flag,bounds,integer", list(_E2E.values()), ids=[f"{c}{f}" for c, f, *_ in _E2E.values()])
def test_out_of_range_through_the_command_line_exits_2_naming_the_flag(cmd, flag, bounds, integer, capsys):
    lo, hi, lo_open = bounds
    bad = [lo if lo_open else _below(lo, integer)] + ([_above(hi, integer)] if hi is not None else [])
    for value in bad:
        assert main([*cmd.split(), flag, _text(value, integer)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"argument {flag}" in err[0], err


def test_memory_sizes_at_their_bounds():
    for t in (common.memory_spec,):
        with pytest.raises(argparse.ArgumentTypeError):
            t("0")
        assert t("1") == "1"
    from expertcache.cli.generate import _byte_count

    assert _byte_count("0") == 0 and _byte_count("1") == 1
    with pytest.raises(argparse.ArgumentTypeError):
        _byte_count("-1")


@pytest.mark.parametrize("name,lo,hi", [("p", 0.0, 1.0), ("lam", 0.0, 1.0), ("alpha", 0.0, None),
                                        ("beta", 0.0, None), ("delta", 0.0, None)])
def test_routing_strengths_at_their_bounds(name, lo, hi):
    for value, taken in _cases(lo, hi, False, False):
        if taken:
            assert getattr(RoutingConfig(**{name: value}), name) == value
        else:
            with pytest.raises(ValueError, match=rf"^{name} must"):
                RoutingConfig(**{name: value})
    for name_i, lo_i in (("top_j", 0), ("m", 0), ("h", 1)):
        assert getattr(RoutingConfig(**{name_i: lo_i}), name_i) == lo_i
        with pytest.raises(ValueError, match=rf"^{name_i} must be ≥ {lo_i}"):
            RoutingConfig(**{name_i: lo_i - 1})


@pytest.mark.parametrize("target,ok", [(0.0, False), (math.nextafter(0.0, 1), True), (0.5, True),
                                       (math.nextafter(1.0, 0), True), (1.0, False)])
def test_miss_rate_target_is_an_open_interval(target, ok):
    routing = RoutingConfig("cache-prior")
    if ok:
        common.check_target(routing, target)
    else:
        with pytest.raises(ValueError, match="--target-miss-rate must be in"):
            common.check_target(routing, target)


def _cgroup(tmp_path, text: str):
    (tmp_path / "proc/self").mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/j\n")
    (tmp_path / "sys/fs/cgroup/j").mkdir(parents=True, exist_ok=True)
    (tmp_path / "sys/fs/cgroup/j/memory.max").write_text(text + "\n")
    return tmp_path


@pytest.mark.parametrize("n,want", [(0, 0), (1, 1), (2**60 - 1, 2**60 - 1), (2**60, None), (2**63 - 4096, None)])
def test_cgroup_no_limit_threshold(tmp_path, n, want):
    """v1 writes "no limit" as a huge page-rounded number: 2^60 and above is no limit, below it a limit."""
    assert cgroup_memory_limit(_cgroup(tmp_path, str(n))) == want


@pytest.mark.parametrize("n", [-1, -2])
def test_a_negative_cgroup_limit_is_refused_naming_the_file(tmp_path, n):
    with pytest.raises(ValueError, match=r"j/memory.max: negative memory limit"):
        cgroup_memory_limit(_cgroup(tmp_path, str(n)))


@pytest.mark.parametrize("delta,refused", [(-1, True), (0, False), (1, False)])
def test_import_floor_at_its_bound(tmp_path, delta, refused):
    line = check_import_floor("generate", _cgroup(tmp_path, str(IMPORT_FLOOR + delta)))
    assert (line is not None) == refused, line


# -- the JSON depth limit --------------------------------------------------------------------------


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth,taken", [(MAX_DEPTH - 1, True), (MAX_DEPTH, True), (MAX_DEPTH + 1, False)])
def test_json_depth_with_more_brackets_than_the_limit(depth, taken):
    """A sibling bracket makes the count of opening brackets exceed the limit even at depth MAX_DEPTH, so the
    depth itself is compared (a document of exactly MAX_DEPTH brackets never reaches that comparison)."""
    for text in (f"[{_nested(depth - 1)}, [], {{}}]", f'{{"a": {_nested(depth - 1)}, "b": [[]]}}',
                 f"[[], {_nested(depth - 1)}]"):
        assert text.count("[") + text.count("{") > MAX_DEPTH or depth < MAX_DEPTH
        if taken:
            assert loads(text) == json.loads(text)
        else:
            with pytest.raises(JSONError, match=rf"^doc: JSON nested deeper than {MAX_DEPTH} levels$"):
                loads(text, what="doc")


@pytest.mark.parametrize("limit", [2, 5])
def test_json_depth_limit_argument_at_its_bound(limit):
    assert loads(_nested(limit) + " ", max_depth=limit) is not None
    assert loads(f"[{_nested(limit - 1)}, []]", max_depth=limit) is not None
    with pytest.raises(JSONError):
        loads(f"[{_nested(limit)}, []]", max_depth=limit)
    with pytest.raises(JSONError):
        loads(_nested(limit + 1), max_depth=limit)


# -- server request fields -------------------------------------------------------------------------

fastapi = pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def client():
    """The app over the shipped granular model (a started engine: a taken request runs, one token at most)."""
    import torch
    from starlette.testclient import TestClient

    from expertcache.offload import OffloadConfig, OffloadedModel
    from expertcache.serve.app import create_app
    from expertcache.serve.engine import Engine

    torch.set_num_threads(1)
    rt = OffloadedModel.from_pretrained("granular", OffloadConfig(io="cached", capacity=8))
    engine = Engine(rt, None, max_batch=4, max_queue=8).start()
    app = create_app(engine, "granular", max_prompt_tokens=20, max_request_bytes=4096, liveview=False)
    with TestClient(app) as c:
        c.context = engine.context
        yield c
    engine.shutdown(0)


def _post(client, **fields):
    body = dict(model="granular", prompt=[5, 6, 7], max_tokens=1, **fields)
    return client.post("/v1/completions", json=body)


@pytest.mark.parametrize("field,value,taken", [
    ("max_tokens", 0, False), ("max_tokens", 1, True),
    ("temperature", -1e-9, False), ("temperature", 0.0, True), ("temperature", 2.0, True),
    ("temperature", 2.0000001, False),
    ("top_p", 0.0, False), ("top_p", 1e-9, True), ("top_p", 1.0, True), ("top_p", 1.0000001, False),
    ("seed", -(1 << 63), True), ("seed", -(1 << 63) - 1, False), ("seed", (1 << 63) - 1, True),
    ("seed", 1 << 63, False),
    ("stop", ["a", "b", "c", "d"], True), ("stop", ["a", "b", "c", "d", "e"], False), ("stop", [""], False),
    ("n", 1, True), ("n", 2, False), ("n", 0, False)])
def test_request_fields_at_their_bounds(client, field, value, taken):
    body = {"max_tokens": value} if field == "max_tokens" else {field: value}
    r = client.post("/v1/completions", json=dict(dict(model="granular", prompt=[5, 6, 7], max_tokens=1), **body))
    assert (r.status_code == 200) == taken, (field, value, r.status_code, r.text)
    if not taken:
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_max_tokens_at_the_room_the_context_leaves(client):
    """A prompt of P tokens leaves context - P new tokens: that many is taken (not run: checked by a prompt
    of max_prompt_tokens and a room of one more is refused)."""
    P = 20
    room = client.context - P
    prompt = list(range(5, 5 + P))
    r = client.post("/v1/completions", json=dict(model="granular", prompt=prompt, max_tokens=room + 1))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert f"at most {room} new tokens" in r.json()["error"]["message"]


@pytest.mark.parametrize("P,taken", [(19, True), (20, True), (21, False)])
def test_prompt_at_max_prompt_tokens(client, P, taken):
    r = client.post("/v1/completions", json=dict(model="granular", prompt=list(range(5, 5 + P)), max_tokens=1))
    assert (r.status_code == 200) == taken, r.text
    if not taken:
        assert r.status_code == 400 and "at most 20 prompt tokens" in r.json()["error"]["message"]


def _body_of(n: int) -> bytes:
    """A valid completion request of exactly ``n`` bytes (padded in the ``user`` field)."""
    base = json.dumps(dict(model="granular", prompt=[5, 6], max_tokens=1, user="")).encode()
    pad = n - len(base)
    assert pad >= 0
    return json.dumps(dict(model="granular", prompt=[5, 6], max_tokens=1, user="x" * pad)).encode()


@pytest.mark.parametrize("n,taken", [(4095, True), (4096, True), (4097, False)])
def test_body_at_max_request_bytes(client, n, taken):
    body = _body_of(n)
    assert len(body) == n
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert (r.status_code == 200) == taken, r.text
    if not taken:
        assert r.status_code == 413


@pytest.mark.parametrize("depth,taken", [(MAX_DEPTH, True), (MAX_DEPTH + 1, False)])
def test_body_nested_at_the_json_limit(client, depth, taken):
    """The body object is level 1; ``user`` holds the rest: one more bracket elsewhere (``prompt``), so the count
    of brackets is over the limit in both cases."""
    body = '{"model": "granular", "prompt": [5, 6], "max_tokens": 1, "user": ' + _nested(depth - 1) + "}"
    r = client.post("/v1/completions", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    # within the limit the JSON is read and the field refused (``user`` must be a string); beyond it, the JSON
    assert ("nested deeper" in msg) != taken, msg
    if taken:
        assert r.json()["error"]["param"] == "user"
