"""Property tests of the one JSON reader every loader uses (multihead.pretrained.bounded_json): within its
bounds it reads what ``json.loads`` reads; past them, and on any bytes at all, it raises a ValueError that
names the file, never RecursionError, Python's digit-limit error or a parser's own exception."""

from __future__ import annotations

import json

import pytest

from multihead.pretrained.bounded_json import MAX_DEPTH, parse_json

hypothesis = pytest.importorskip("hypothesis", reason="the property tests need hypothesis (the test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PROPS = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
WHERE = "config file 'x/config.json'"
#: Text that looks like structure: brackets, quotes and backslashes inside strings must not count.
TRICKY = st.text(alphabet='[]{}",:\\ab\n\u00e9', max_size=12)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**19), 10**19),
    st.floats(allow_nan=False, allow_infinity=False),
    TRICKY,
)
VALUES = st.recursive(
    SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TRICKY, inner, max_size=4)),
    max_leaves=30,
)  # fmt: skip


def _parse(raw: bytes):
    return parse_json(raw, WHERE, "write it again", max_values=10_000)


@PROPS
@given(value=VALUES, indent=st.sampled_from([None, 0, 2]))
def test_values_within_the_bounds_read_as_json_reads_them(value, indent):
    raw = json.dumps(value, indent=indent).encode()
    assert _parse(raw) == json.loads(raw)


@PROPS
@given(depth=st.integers(1, 3 * MAX_DEPTH), inner=TRICKY, kind=st.sampled_from(["list", "object"]))
def test_nesting_is_refused_exactly_past_the_bound(depth, inner, kind):
    value: object = inner
    for _ in range(depth):
        value = [value] if kind == "list" else {"k[": value}
    raw = json.dumps(value).encode()
    if depth <= MAX_DEPTH:
        assert _parse(raw) == value
    else:
        with pytest.raises(ValueError, match=rf"config\.json' nests objects or lists more than {MAX_DEPTH}"):
            _parse(raw)


@PROPS
@given(digits=st.integers(21, 6000), field=st.sampled_from(["vocab_size", "rope_theta"]))
def test_long_numbers_are_refused_naming_the_field(digits, field):
    raw = ('{"a": 1, "' + field + '": ' + "7" * digits + "}").encode()
    with pytest.raises(ValueError, match=rf"config\.json': {field} holds an integer of {digits} digits"):
        _parse(raw)


@PROPS
@given(raw=st.one_of(st.binary(max_size=200), VALUES.map(lambda v: json.dumps(v).encode()[:-1])))
def test_any_bytes_give_a_value_or_a_value_error_naming_the_file(raw):
    try:
        _parse(raw)
    except ValueError as e:
        assert "config.json'" in str(e)


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_numbers_json_does_not_have_are_refused(text):
    with pytest.raises(ValueError, match=r"config\.json': rope\.theta holds"):
        _parse(('{"rope": {"theta": ' + text + "}}").encode())


def test_more_values_than_allowed_are_refused_before_parsing():
    with pytest.raises(ValueError, match=r"holds more than 10000 JSON values"):
        _parse(json.dumps(list(range(20_000))).encode())
