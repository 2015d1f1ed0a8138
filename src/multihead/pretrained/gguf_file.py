"""A GGUF file (llama.cpp's format) opened so that a bad file costs no more than its own size.

    header (magic, version, counts) -> every metadata entry and tensor record walked with its length
    bounded by the bytes left in the file -> every tensor's type supported and its data inside the file
    -> only then ``gguf.GGUFReader`` (llama.cpp's own reader) maps the file and reads the values

The walk only checks sizes: the values are read by ``gguf``. It exists because the reader trusts the
counts it finds (an array that claims 2**60 numbers, a string longer than the file) and fails on them
with an ``IndexError`` or runs for a very long time; here each such file gets one ``ValueError`` naming
the file and the entry. Little-endian GGUF versions 2 and 3 are read.

The reader fetches its values through a plain ``numpy.ndarray`` view of its memory map (its ``_get``
step, otherwise the same): numpy's ``memmap`` subclass costs a Python call per value, and a vocabulary
has 100,000 of them (2.2 s for SmolLM2's file against 0.6 s).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .files import MAX_TENSORS, confined

__all__ = ["GGUF_TYPES", "MAX_ENTRIES", "GGUFTensorInfo", "open_gguf", "scan_gguf", "tensor_bytes"]

_MAGIC = b"GGUF"
_FIX = "download the .gguf file again or convert the model with llama.cpp's convert_hf_to_gguf.py"
#: The most metadata entries a file may hold (llama.cpp's files hold a few dozen).
MAX_ENTRIES = 1 << 16
#: The most elements of one metadata array (the largest vocabularies and merge lists: a few 100,000).
MAX_ARRAY = 1 << 22
#: The longest metadata string (a chat template takes a few KB).
MAX_STRING = 16 << 20
#: The most dimensions of a tensor (GGML_MAX_DIMS).
MAX_TENSOR_DIMS = 4
#: Sizes in bytes of the metadata scalar types, by GGUF value type number (8 string, 9 array).
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
#: The tensor types read, by ggml type number: (name, elements per block, bytes per block).
GGUF_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor record: its name, ggml type name, shape in ggml order (fastest dimension first) and
    the byte range of its data from the start of the file."""

    name: str
    type_name: str
    dims: tuple[int, ...]
    start: int
    nbytes: int


class _Cursor:
    """Reads little-endian numbers and strings from ``buf`` with every length checked against its end."""

    def __init__(self, buf: Any, where: str):
        self.buf, self.pos, self.end, self.where = buf, 0, len(buf), where

    def fail(self, why: str) -> ValueError:
        return ValueError(f"{self.where} is not a readable GGUF file ({why}); {_FIX}")

    def take(self, n: int, what: str) -> int:
        if n > self.end - self.pos:
            raise self.fail(
                f"{what} needs {n} bytes but the file ends {self.end - self.pos} bytes later: truncated"
            )
        start = self.pos
        self.pos += n
        return start

    def u32(self, what: str) -> int:
        return int(struct.unpack_from("<I", self.buf, self.take(4, what))[0])

    def u64(self, what: str) -> int:
        return int(struct.unpack_from("<Q", self.buf, self.take(8, what))[0])

    def string(self, what: str, limit: int = MAX_STRING) -> bytes:
        n = self.u64(f"the length of {what}")
        if n > limit:
            raise self.fail(f"{what} claims {n} bytes, more than the {limit} read")
        start = self.take(n, what)
        return bytes(self.buf[start : start + n])


def tensor_bytes(type_name: str, dims: tuple[int, ...]) -> int:
    """Bytes of a tensor of ggml type ``type_name`` and shape ``dims`` (ggml order)."""
    _, block, size = next(v for v in GGUF_TYPES.values() if v[0] == type_name)
    n = 1
    for d in dims:
        n *= d
    return n // block * size


def _value(c: _Cursor, kind: int, key: str) -> Any:
    """Skip one metadata value of GGUF type ``kind``, checked; return it when it is a scalar u32."""
    if kind in _SCALARS:
        start = c.take(_SCALARS[kind], f"the value of {key!r}")
        return struct.unpack_from("<I", c.buf, start)[0] if kind == 4 else None
    if kind == 8:
        c.string(f"the value of {key!r}")
        return None
    if kind != 9:
        raise c.fail(f"metadata entry {key!r} has the unknown value type {kind}")
    item, count = c.u32(f"the item type of {key!r}"), c.u64(f"the length of {key!r}")
    if count > MAX_ARRAY:
        raise c.fail(f"metadata array {key!r} claims {count} items, more than the {MAX_ARRAY} read")
    if item in _SCALARS:
        c.take(count * _SCALARS[item], f"the {count} items of {key!r}")
    elif item == 8:
        if count * 8 > c.end - c.pos:
            raise c.fail(
                f"metadata array {key!r} claims {count} strings, more than the file holds: truncated"
            )
        for _ in range(count):
            c.string(f"an item of {key!r}")
    else:
        raise c.fail(f"metadata array {key!r} has items of type {item}, not numbers or strings")
    return None


def _tensor(c: _Cursor, i: int) -> tuple[str, str, tuple[int, ...], int]:
    """One tensor record (name, type name, dims, offset in the data section), checked."""
    raw = c.string(f"the name of tensor {i}", 1 << 16)
    name = raw.decode("utf-8", errors="replace")
    n_dims = c.u32(f"the dimension count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_TENSOR_DIMS:
        raise c.fail(f"tensor {name!r} has {n_dims} dimensions, not 1 to {MAX_TENSOR_DIMS}")
    dims = tuple(c.u64(f"a dimension of tensor {name!r}") for _ in range(n_dims))
    kind = c.u32(f"the type of tensor {name!r}")
    offset = c.u64(f"the data offset of tensor {name!r}")
    if kind not in GGUF_TYPES:
        known = ", ".join(v[0] for v in GGUF_TYPES.values())
        raise ValueError(
            f"{c.where}: tensor {name!r} has ggml type {kind}, which multihead does not read (it reads "
            f"{known}); convert the model to one of these with llama.cpp's llama-quantize"
        )
    type_name, block, _ = GGUF_TYPES[kind]
    if dims[0] % block or any(d < 1 for d in dims):
        raise c.fail(
            f"tensor {name!r} of type {type_name} has dims {dims}: its first must be a multiple of {block}"
        )
    return name, type_name, dims, offset


def scan_gguf(buf: Any, where: str) -> tuple[list[GGUFTensorInfo], int]:
    """The tensor records of the GGUF bytes ``buf`` (a mapped file) and the number of metadata entries,
    after every length in the header was checked against the end of ``buf``.

    Raises:
        ValueError: not a GGUF file, a version other than 2 or 3, counts or lengths the file cannot hold,
            a tensor type multihead does not read, tensor data past the end of the file (``where`` names
            the file).
    """
    c = _Cursor(buf, where)
    if bytes(buf[:4]) != _MAGIC:
        raise c.fail(f"it starts with {bytes(buf[:4])!r}, not the magic b'GGUF'")
    c.take(4, "the magic")
    version = c.u32("the version")
    if version not in (2, 3):
        raise c.fail(f"version {version}; multihead reads little-endian GGUF versions 2 and 3")
    n_tensors, n_kv = c.u64("the tensor count"), c.u64("the metadata count")
    if n_tensors > MAX_TENSORS or n_kv > MAX_ENTRIES:
        raise c.fail(
            f"it claims {n_tensors} tensors and {n_kv} metadata entries, more than the {MAX_TENSORS} and "
            f"{MAX_ENTRIES} read"
        )
    alignment = 32
    for _ in range(n_kv):
        key = c.string("a metadata key", 1 << 16).decode("utf-8", errors="replace")
        got = _value(c, c.u32(f"the type of {key!r}"), key)
        if key == "general.alignment" and got is not None:
            alignment = got
    if alignment < 1 or alignment & (alignment - 1):
        raise c.fail(f"general.alignment is {alignment}, not a power of two")
    records = [_tensor(c, i) for i in range(n_tensors)]
    data = -(-c.pos // alignment) * alignment
    out = []
    for name, type_name, dims, offset in records:
        nbytes = tensor_bytes(type_name, dims)
        if data + offset + nbytes > len(buf):
            raise c.fail(
                f"the data of tensor {name!r} ({nbytes} bytes) lies past the end of the file: truncated"
            )
        out.append(GGUFTensorInfo(name, type_name, dims, data + offset, nbytes))
    return out, n_kv


def open_gguf(path: str | Path) -> tuple[Any, list[GGUFTensorInfo], str]:
    """``(gguf.GGUFReader, tensor records, where)`` for the GGUF file ``path``, checked by
    :func:`scan_gguf` before the reader sees it; ``where`` names the file for messages.

    Raises:
        ImportError: the ``gguf`` package is missing (says how to install it).
        ValueError: the file is missing, a link out of its folder (see
            :func:`~multihead.pretrained.files.confined`), or what :func:`scan_gguf` raises.
    """
    try:
        import gguf
    except ImportError:
        raise ImportError(
            'reading GGUF files needs the gguf package: pip install "multihead[lm]" (or pip install gguf)'
        ) from None
    p = confined(path, None, "GGUF", _FIX)
    where = f"GGUF file {str(p)!r}"
    with p.open("rb") as f:
        if p.stat().st_size < 24:
            raise ValueError(f"{where} holds {p.stat().st_size} bytes, fewer than a GGUF header; {_FIX}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            infos, _ = scan_gguf(buf, where)
    try:
        reader = _reader_class(gguf)(str(p))
    except (ValueError, KeyError, IndexError, TypeError) as e:  # duplicate keys or tensors, bad values
        raise ValueError(f"{where} is not a readable GGUF file ({e}); {_FIX}") from None
    return reader, infos, where


def _reader_class(gguf: Any) -> type:
    """``gguf.GGUFReader`` reading through a plain ndarray view of its memory map (see the module)."""

    class Reader(gguf.GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            itemsize = int(np.empty([], dtype=dtype).itemsize)
            arr = plain[offset : offset + itemsize * count].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return Reader
