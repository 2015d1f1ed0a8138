"""Fuzzing the checkpoint and config loaders (hypothesis): truncated files, flipped bytes, config values of
the wrong type or size, safetensors headers that lie about dtypes, shapes and offsets.

Whatever the files hold, ``mh.pretrained.load`` and ``mh.heads.load_converted`` either load a model or
raise a ValueError that names the checkpoint; and the peak resident memory of the process grows by no
more than a small constant (plus a few times the checkpoint's size) over the call, so a file cannot make
the loader allocate what its header or config claims.
"""

from __future__ import annotations

import json
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import multihead as mh

from .checkpoints import CONFIG, write_tiny

hypothesis = pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (the test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

#: Peak growth allowed over one load: building and loading a tiny model, plus 8x the checkpoint's bytes.
BASE_BYTES = 96 << 20
FUZZ = settings(
    max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True
)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def _can_reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        _status_kib("VmHWM")
        return True
    except OSError:
        return False


PEAK = _can_reset_peak()


def _load_bounded(load: Callable[[Path], object], folder: Path, base_bytes: int = 0) -> None:
    """``load(folder)``: a model, or a ValueError naming the folder; the peak memory stays bounded (by
    the files' size and, for a converted checkpoint, ``base_bytes``: the base model it names)."""
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) + base_bytes
    if PEAK:
        Path("/proc/self/clear_refs").write_text("5")  # the peak restarts at the current size
        base = _status_kib("VmRSS")
    try:
        load(folder)
    except ValueError as e:
        assert str(folder) in str(e), f"the error does not name the checkpoint: {e}"
    if PEAK:
        grown = (_status_kib("VmHWM") - base) * 1024
        assert grown <= BASE_BYTES + 8 * size, (
            f"the peak grew by {grown >> 20} MiB for a {size}-byte checkpoint"
        )


@pytest.fixture(scope="module")
def tiny() -> dict[str, bytes]:
    """The files of the tiny checkpoint; warms the loader up (imports, first allocations) once."""
    with tempfile.TemporaryDirectory() as d:
        folder = write_tiny(Path(d))
        mh.pretrained.load(folder)
        if not PEAK:
            print("peak memory is not checked: /proc/self/clear_refs cannot be written here")
        return {p.name: p.read_bytes() for p in folder.iterdir()}


def _write(files: dict[str, bytes]) -> tuple[tempfile.TemporaryDirectory, Path]:
    d = tempfile.TemporaryDirectory()
    for name, data in files.items():
        (Path(d.name) / name).write_bytes(data)
    return d, Path(d.name)


def _fuzz(
    files: dict[str, bytes], load: Callable[[Path], object] = mh.pretrained.load, base_bytes: int = 0
) -> None:
    d, folder = _write(files)
    with d:
        _load_bounded(load, folder, base_bytes)


def _minilm_bytes() -> int:
    """The size of the bundled MiniLM, the base a surgery.json without ``base`` names (0 if absent)."""
    try:
        return sum(p.stat().st_size for p in mh.pretrained.minilm_dir().rglob("*") if p.is_file())
    except (ValueError, ImportError):
        return 0


NAMES = st.sampled_from(["config.json", "model.safetensors"])


@FUZZ
@given(name=NAMES, frac=st.floats(0.0, 1.0))
def test_truncated_files(tiny, name, frac):
    data = tiny[name]
    _fuzz({**tiny, name: data[: int(frac * len(data))]})


@FUZZ
@given(
    name=NAMES, flips=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(1, 255)), min_size=1, max_size=8)
)
def test_flipped_bytes(tiny, name, flips):
    data = bytearray(tiny[name])
    for where, mask in flips:
        data[min(int(where * len(data)), len(data) - 1)] ^= mask
    _fuzz({**tiny, name: bytes(data)})


VALUES = st.one_of(
    st.integers(-3, 1 << 40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-2, 2), max_size=3),
    st.dictionaries(
        st.sampled_from(["rope_type", "rope_theta", "type"]), st.one_of(st.text(max_size=3), st.integers())
    ),
)
FIELDS = st.sampled_from(
    [
        *CONFIG,
        "head_dim",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "sliding_window",
        "hidden_act",
        "layer_types",
    ]
)


@FUZZ
@given(changes=st.dictionaries(FIELDS, VALUES, min_size=1, max_size=3), drop=st.lists(FIELDS, max_size=2))
def test_config_values_of_any_type_and_size(tiny, changes, drop):
    config = {k: v for k, v in {**CONFIG, **changes}.items() if k not in drop}
    _fuzz({**tiny, "config.json": json.dumps(config).encode()})


def _split(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: dict, payload: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload


ENTRY_EDITS = st.one_of(
    st.tuples(st.just("shape"), st.lists(st.integers(-1, 1 << 40), max_size=3)),
    st.tuples(st.just("dtype"), st.sampled_from(["F16", "BF16", "F64", "I8", "BOOL", "X", 5, None])),
    st.tuples(st.just("data_offsets"), st.lists(st.integers(-1, 1 << 40), max_size=3)),
)


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 100), ENTRY_EDITS), min_size=1, max_size=3))
def test_safetensors_headers_that_lie(tiny, edits):
    header, payload = _split(tiny["model.safetensors"])
    names = sorted(k for k in header if k != "__metadata__")
    for i, (field, value) in edits:
        header[names[i % len(names)]][field] = value
    _fuzz({**tiny, "model.safetensors": _join(header, payload)})


@pytest.fixture(scope="module")
def converted() -> dict[str, bytes]:
    """The files of a converted checkpoint (a GQA copy of a tiny preset model)."""
    with tempfile.TemporaryDirectory() as d:
        lm = mh.heads.to_gqa(mh.pretrained.random_lm("llama-tiny"), 1)
        mh.heads.save_converted(lm, [{"to": "gqa", "n_kv_heads": 1}], d, base={"preset": "llama-tiny"})
        mh.heads.load_converted(d)
        return {p.name: p.read_bytes() for p in Path(d).iterdir()}


@FUZZ
@given(
    name=st.sampled_from(["surgery.json", "model.safetensors"]),
    frac=st.floats(0.0, 1.0),
    flip=st.integers(0, 255),
)
def test_converted_checkpoints_truncated_or_flipped(converted, name, frac, flip):
    data = bytearray(converted[name])
    cut = int(frac * len(data))
    if flip:
        data[min(cut, len(data) - 1)] ^= flip
    else:
        data = data[:cut]
    # a flipped "base" key falls back to the format's default base, the bundled MiniLM: allow for it
    _fuzz({**converted, name: bytes(data)}, mh.heads.load_converted, _minilm_bytes())


def test_the_intact_files_load_within_the_bound(tiny, converted):
    d, folder = _write(tiny)
    with d:
        _load_bounded(mh.pretrained.load, folder)
        assert mh.pretrained.load(folder)(torch.tensor([[1, 2]])).shape == (1, 2, CONFIG["vocab_size"])
    d, folder = _write(converted)
    with d:
        assert isinstance(mh.heads.load_converted(folder), mh.TransformerLM)


#: Text spliced into a config.json or a safetensors header: deep nesting, huge numbers, JSON's missing
#: numbers, strings full of brackets.
HOSTILE = st.one_of(
    st.integers(1, 5000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 5000).map(lambda n: '{"a":' * n + "0" + "}" * n),
    st.integers(15, 6000).map(lambda n: "9" * n),
    st.sampled_from(["NaN", "-Infinity", "1e999", '"[[[[{{{{\\\\"', "[" * 70]),
)


@FUZZ
@given(text=HOSTILE, field=FIELDS)
def test_hostile_json_in_a_config(tiny, text, field):
    raw = json.dumps({**CONFIG, field: 0})
    _fuzz({**tiny, "config.json": raw.replace(f'"{field}": 0', f'"{field}": {text}').encode()})


@FUZZ
@given(text=HOSTILE)
def test_hostile_json_in_a_safetensors_header(tiny, text):
    header, payload = _split(tiny["model.safetensors"])
    raw = json.dumps({**header, "__metadata__": 0}).replace('"__metadata__": 0', f'"__metadata__": {text}')
    data = struct.pack("<Q", len(raw.encode())) + raw.encode() + payload
    _fuzz({**tiny, "model.safetensors": data})
