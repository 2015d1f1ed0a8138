"""Reading and writing the files a user names, with errors that name the file, what was wrong and the fix.

A Hugging Face or sentence-transformers directory holds JSON configs, safetensors weights and a
``tokenizer.json``. Each reader here turns the parser's own exception (a ``JSONDecodeError`` with no
file name, a ``SafetensorError`` traceback, a ``UnicodeDecodeError``) into a ``ValueError`` that says
which file failed and how to get a good one. :func:`read_safetensors_header` reads only a weights file's
header (names, dtypes, shapes), checked against the file's size, so a loader can compare it with a
config before it allocates anything.

Writes a user keeps go through :func:`atomic_write` (:mod:`.atomic`, re-exported here): a temporary
file in the same folder, renamed over the target only once it is complete, and removed on an error,
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .atomic import atomic_folder, atomic_write, temporary_name

__all__ = [
    "MAX_HEADER_BYTES",
    "atomic_folder",
    "atomic_write",
    "read_json",
    "read_safetensors",
    "read_safetensors_header",
    "read_safetensors_metadata",
    "read_tokenizer",
    "shard_path",
    "temporary_name",
]

_RESAVE = "re-save it with model.save_pretrained(DIR) or download the checkpoint again"


def read_json(path: str | Path, what: str = "config", *, fix: str = _RESAVE) -> dict[str, Any]:
    """The JSON object in ``path``.

    Args:
        path: the file.
        what: what the file is, for the message (e.g. "config", "sharded index").
        fix: how to get a good file, for the message.

    Raises:
        ValueError: the file is missing, not UTF-8 text, not valid JSON, or not a JSON object.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} file {str(p)!r} does not exist; {fix}")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{what} file {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start}); {fix}"
        ) from e
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{what} file {str(p)!r} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); " + fix
        ) from e
    if not isinstance(obj, dict):
        kind = type(obj).__name__
        raise ValueError(f"{what} file {str(p)!r} holds a JSON {kind}, expected an object; {fix}")
    return obj


def read_safetensors(path: str | Path, *, fix: str = _RESAVE) -> dict[str, Tensor]:
    """Every tensor of the safetensors file ``path`` (on the CPU).

    Raises:
        ValueError: the file is missing, truncated or not a safetensors file (the message names it).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    _raw_header(p, fix)  # sizes checked before safetensors allocates anything
    try:
        return load_file(str(p))
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"weights file {str(p)!r} ({p.stat().st_size} bytes) is not a readable safetensors file "
            f"(truncated or corrupted: {e}); {fix}"
        ) from e


def read_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` at ``path``.

    Raises:
        ValueError: the file is missing or not a tokenizer the ``tokenizers`` library can read.
    """
    from tokenizers import Tokenizer

    p = Path(path)
    if not p.is_file():
        raise ValueError(
            f"tokenizer file {str(p)!r} does not exist; save it with tokenizer.save_pretrained(DIR) "
            "(a fast tokenizer writes tokenizer.json)"
        )
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises its own Exception subclass for every parse failure
        raise ValueError(
            f"tokenizer file {str(p)!r} could not be read by the tokenizers library ({e}); "
            "save it again with tokenizer.save_pretrained(DIR)"
        ) from e


#: The largest safetensors header read (the safetensors format caps it at 100 MB too).
MAX_HEADER_BYTES = 100 << 20

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors_header(path: str | Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of the safetensors file ``path``, from its header alone.

    The header (an 8-byte little-endian length, then that many bytes of JSON) is read with its length
    bounded by the file and by :data:`MAX_HEADER_BYTES`; every tensor's byte range must lie in the file
    and match its dtype and shape, so nothing it claims can make a reader allocate more than the file.

    Raises:
        ValueError: the file is missing, shorter than its header says, or the header is not a valid
            safetensors header (the message names the file and the entry).
    """
    header, data, bad = _raw_header(Path(path))
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, entry in header.items():
        if name != "__metadata__":
            out[name] = _header_entry(name, entry, data, bad)
    return out


def read_safetensors_metadata(path: str | Path, *, fix: str = _RESAVE) -> dict[str, Any]:
    """The ``__metadata__`` object of the safetensors file ``path`` ({} when it has none).

    Raises:
        ValueError: what :func:`read_safetensors_header` raises.
    """
    header, _, bad = _raw_header(Path(path), fix)
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict):
        raise bad("__metadata__ is not an object")
    return meta


def _raw_header(p: Path, fix: str = _RESAVE) -> tuple[dict[str, Any], int, Callable[[str], ValueError]]:
    """The header object of ``p``, the bytes of data after it, and a maker of errors naming ``p``."""
    if not p.is_file():
        raise ValueError(f"weights file {str(p)!r} does not exist; {fix}")
    size = p.stat().st_size

    def bad(why: str) -> ValueError:
        return ValueError(
            f"weights file {str(p)!r} ({size} bytes) is not a readable safetensors file (truncated or "
            f"corrupted: {why}); {fix}"
        )

    with p.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad("shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise bad(f"the header claims {n} bytes, the file holds {size - 8} after the length")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the header is not JSON text: {e}") from e
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    return header, size - 8 - n, bad


def _header_entry(name: str, entry: Any, data: int, bad) -> tuple[torch.dtype, tuple[int, ...]]:
    """One tensor's (dtype, shape), checked against the ``data`` bytes after the header."""
    if not isinstance(entry, dict):
        raise bad(f"entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _SAFETENSORS_DTYPES:
        raise bad(f"tensor {name!r} has dtype {dtype!r}, not one of {list(_SAFETENSORS_DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"tensor {name!r} has shape {shape!r}, not a list of ints >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise bad(f"tensor {name!r} has data_offsets {offsets!r}, not [start, end]")
    start, end = offsets
    want = math.prod(shape) * torch.empty(0, dtype=_SAFETENSORS_DTYPES[dtype]).element_size()
    if not 0 <= start <= end <= data or end - start != want:
        raise bad(
            f"tensor {name!r} ({dtype} {shape}) needs {want} bytes at {offsets}, the file holds {data} "
            "bytes of data"
        )
    return _SAFETENSORS_DTYPES[dtype], tuple(shape)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def shard_path(root: Path, name: Any, index: Path) -> Path:
    """The shard file ``name`` of a sharded index, confined to the checkpoint folder ``root``.

    The name is checked as written (a Hugging Face cache links its shards to blobs elsewhere, so the
    link's target is not): a plain relative path with no ``..`` part.

    Raises:
        ValueError: a name that is not a string, is absolute or climbs out with ``..`` (naming the index).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"sharded index {str(index)!r} names the shard {name!r}, not a file name; {_RESAVE}")
    parts = Path(name).parts
    if Path(name).is_absolute() or "\\" in name or ".." in parts:
        raise ValueError(
            f"sharded index {str(index)!r} names the shard {name!r} outside the checkpoint folder "
            f"{str(root)!r}; shard names must be file names inside it ({_RESAVE})"
        )
    return root / name
