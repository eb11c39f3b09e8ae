"""The one JSON reader (expertcache.jsonsafe): equal to json.loads within the depth limit, one clear
ValueError naming the input beyond it or on malformed text, never a RecursionError."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from expertcache.jsonsafe import MAX_DEPTH, JSONError, depth, loads

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=30,
)


def nested_depth(v) -> int:
    """Independent: the nesting depth of a parsed value, by recursion over the Python object."""
    if isinstance(v, list):
        return 1 + max((nested_depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((nested_depth(x) for x in v.values()), default=0)
    return 0


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_equal_to_json_loads_and_depth_independent(v):
    text = json.dumps(v)
    assert depth(text) == nested_depth(v)
    assert depth(text.encode()) == nested_depth(v)
    assert loads(text) == json.loads(text)


def test_brackets_inside_strings_do_not_count():
    text = json.dumps({"a": "[[[[{{{{" * 100, "b": "\\\"]]]]"})
    assert depth(text) == 1
    assert loads(text)["a"].startswith("[[[[")


@pytest.mark.parametrize("n", [MAX_DEPTH, MAX_DEPTH + 1, 5000, 200_000])
def test_depth_limit_exactly(n):
    text = "[" * n + "]" * n
    if n <= MAX_DEPTH:
        assert nested_depth(loads(text)) == n
    else:
        with pytest.raises(JSONError, match=r"^trace metadata: JSON nested deeper than 64 levels$"):
            loads(text, what="trace metadata")


def test_malformed_names_the_input():
    with pytest.raises(JSONError, match=r"^config\.json: not valid JSON \(.* line 1 column"):
        loads('{"a": ', what="config.json")
    with pytest.raises(JSONError, match=r"^body: not UTF-8"):
        loads(b'"\xff"', what="body")
    assert issubclass(JSONError, ValueError)
