"""JSON text parsed with its cost bounded before the parser runs: every JSON file the loaders read
(config.json, surgery.json, a shard index, a sentence-transformers config, a safetensors header) goes
through :func:`parse_json`.

Python's parser recurses once per nesting level (a deep ``[[[[...]]]]`` ends in ``RecursionError``),
builds every value it reads (a 99 MB header of empty entries becomes 1.8 GB of dicts), and refuses an
integer of more than 4300 digits with its own message that names no file. So the text is first scanned
for its structure (nesting depth and number of values, strings skipped) in fixed-size chunks, and only a
text within the bounds is parsed; numbers are then checked by size. Each refusal is a ``ValueError``
that names the file and, where it can, the field.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["MAX_DEPTH", "MAX_DIGITS", "parse_json"]

#: The deepest nesting accepted (Hugging Face configs and safetensors headers nest 2 to 4 levels).
MAX_DEPTH = 64
#: The longest integer accepted, in digits (an int64 or uint64 has at most 20).
MAX_DIGITS = 20
#: The longest number text accepted for a float (``-1.2345678901234567e-308`` has 24 characters).
MAX_FLOAT_CHARS = 64
_CHUNK = 1 << 22  # bytes scanned at a time: the scan's memory does not grow with the text
_QUOTE, _COMMA = ord('"'), ord(",")
_OPENS, _CLOSES = (ord("["), ord("{")), (ord("]"), ord("}"))


class _Refused:
    """A number the parser read but the checks refuse; stands in its place until it is reported."""

    def __init__(self, why: str) -> None:
        self.why = why


def parse_json(raw: bytes, where: str, fix: str, *, max_values: int, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value of ``raw``, parsed only once its structure is known to be within bounds.

    Args:
        raw: the JSON text (UTF-8).
        where: the file, for the message (e.g. ``"config file '/ckpt/config.json'"``).
        fix: how to get a good file, for the message.
        max_values: the most values (numbers, strings, objects, lists, ...) the text may hold.
        max_depth: the deepest nesting of objects and lists accepted.

    Raises:
        ValueError: text nested deeper than ``max_depth`` (with its line and column), holding more
            than ``max_values`` values, not UTF-8 or not JSON, or a number that is NaN, infinite, an
            integer of more than :data:`MAX_DIGITS` digits or a float of more than
            :data:`MAX_FLOAT_CHARS` characters (naming the field that holds it).
    """
    import json

    _check_structure(raw, where, fix, max_values, max_depth)
    refused: list[_Refused] = []
    unit = {int: "digits", float: "characters"}

    def number(kind: type, limit: int, what: str):
        def parse(text: str) -> Any:
            size = len(text) - text.startswith("-")  # digits (an int), characters (a float)
            value = kind(text) if size <= limit else _Refused(f"{what} of {size} {unit[kind]}")
            if isinstance(value, float) and not math.isfinite(value):
                value = _Refused(f"the number {text[:24]} (out of float range)")
            if isinstance(value, _Refused):
                refused.append(value)
            return value

        return parse

    def constant(text: str) -> _Refused:  # NaN, Infinity, -Infinity: not JSON numbers
        refused.append(_Refused(f"{text} (not a JSON number)"))
        return refused[-1]

    try:
        value = json.loads(
            raw.decode("utf-8"),
            parse_int=number(int, MAX_DIGITS, "an integer"),
            parse_float=number(float, MAX_FLOAT_CHARS, "a number"),
            parse_constant=constant,
        )
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{where} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); {fix}"
        ) from None
    if refused:
        field, bad = next(_refused_fields(value, ""))
        raise ValueError(f"{where}: {field or 'the value'} holds {bad.why}; {fix}")
    return value


def _refused_fields(value: Any, path: str) -> Iterator[tuple[str, _Refused]]:
    """(field path, refused number) of every refused number in ``value`` (depth already bounded)."""
    if isinstance(value, _Refused):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _refused_fields(v, f"{path}.{k}" if path else str(k)[:80])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _refused_fields(v, f"{path}[{i}]")


def _check_structure(raw: bytes, where: str, fix: str, max_values: int, max_depth: int) -> None:
    """Refuse text nested deeper than ``max_depth`` or holding more than ``max_values`` values, by a
    scan of its brackets and commas outside strings, ``_CHUNK`` bytes at a time (no recursion).

    Escaped backslashes and quotes are blanked first (same length, so offsets stay), after which every
    remaining quote opens or closes a string.
    """
    clean = raw.replace(b"\\\\", b"  ").replace(b'\\"', b"  ")
    data = (
        torch.frombuffer(bytearray(clean), dtype=torch.uint8) if clean else torch.zeros(0, dtype=torch.uint8)
    )
    quotes, depth, values = 0, 0, 0
    for start in range(0, data.numel(), _CHUNK):
        chunk = data[start : start + _CHUNK]
        is_quote = chunk == _QUOTE
        outside = (is_quote.cumsum(0, dtype=torch.int32) + quotes) % 2 == 0  # closing quotes included
        opens = ((chunk == _OPENS[0]) | (chunk == _OPENS[1])) & outside
        closes = ((chunk == _CLOSES[0]) | (chunk == _CLOSES[1])) & outside
        level = depth + (opens.to(torch.int32) - closes.to(torch.int32)).cumsum(0, dtype=torch.int32)
        if int(level.max()) > max_depth:
            at = start + int((level > max_depth).nonzero()[0])
            line = raw.count(b"\n", 0, at) + 1
            column = at - raw.rfind(b"\n", 0, at)
            raise ValueError(
                f"{where} nests objects or lists more than {max_depth} levels deep (line {line}, column "
                f"{column}); {fix}"
            )
        values += int(opens.sum()) + int(((chunk == _COMMA) & outside).sum())
        if values > max_values:
            raise ValueError(f"{where} holds more than {max_values} JSON values; {fix}")
        quotes += int(is_quote.sum())
        depth = int(level[-1])
