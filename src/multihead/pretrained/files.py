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

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .atomic import atomic_folder, atomic_write, temporary_name
from .bounded_json import parse_json

__all__ = [
    "MAX_HEADER_BYTES",
    "atomic_folder",
    "atomic_write",
    "confined",
    "read_json",
    "read_safetensors",
    "read_safetensors_header",
    "read_safetensors_metadata",
    "read_tokenizer",
    "shard_path",
    "temporary_name",
]

_RESAVE = "re-save it with model.save_pretrained(DIR) or download the checkpoint again"

#: The largest safetensors header read (the safetensors format caps it at 100 MB too).
MAX_HEADER_BYTES = 100 << 20
#: A header may exceed this only by the bytes of tensor data that follow it.
HEADER_FLOOR_BYTES = 1 << 20
#: The most tensors one safetensors file may hold (a shard of the largest models holds a few thousand).
MAX_TENSORS = 1 << 17
#: The most dimensions a tensor may have.
MAX_DIMS = 16
#: The JSON files read by :func:`read_json`: their largest size and number of values.
MAX_JSON_BYTES = 64 << 20
MAX_JSON_VALUES = 1 << 21
#: The largest tokenizer.json read (the largest vocabularies in use take about 20 MB).
MAX_TOKENIZER_BYTES = 256 << 20


def read_json(
    path: str | Path,
    what: str = "config",
    *,
    fix: str = _RESAVE,
    root: str | Path | None = None,
    max_values: int = MAX_JSON_VALUES,
) -> dict[str, Any]:
    """The JSON object in ``path``, read with its cost bounded (:func:`~.bounded_json.parse_json`).

    Args:
        path: the file.
        what: what the file is, for the message (e.g. "config", "sharded index").
        fix: how to get a good file, for the message.
        root: the folder the file belongs to (default: its own folder); see :func:`confined`.
        max_values: the most JSON values the file may hold.

    Raises:
        ValueError: the file is missing, a symbolic link out of ``root``, larger than
            :data:`MAX_JSON_BYTES`, not UTF-8 text, not valid JSON, nested too deep, holding a number
            out of range, or not a JSON object (naming the file and, where it can, the field).
    """
    p = confined(path, root, what, fix)
    where = f"{what} file {str(p)!r}"
    size = p.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{where} holds {size} bytes, more than the {MAX_JSON_BYTES} read; {fix}")
    obj = parse_json(p.read_bytes(), where, fix, max_values=max_values)
    if not isinstance(obj, dict):
        raise ValueError(f"{where} holds a JSON {type(obj).__name__}, expected an object; {fix}")
    return obj


def confined(path: str | Path, root: str | Path | None, what: str, fix: str = _RESAVE) -> Path:
    """``path``, checked to be a regular file that stays inside its folder ``root`` (default: the
    file's own folder) after symbolic links are followed.

    A link may point inside ``root``; in the Hugging Face cache layout (``root`` inside
    ``<model>/snapshots/<revision>``) it may also point into that model's ``blobs`` folder, where the
    cache keeps the files. Any other link (to ``/etc/shadow``, to another user's files) is refused
    before the file is opened, so nothing of its contents reaches a message.

    Raises:
        ValueError: the file is missing, not a regular file, or a link out of ``root``.
    """
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise ValueError(f"{what} file {str(p)!r} does not exist; {fix}")
    base = Path(p.parent if root is None else root).resolve()
    target = p.resolve()
    allowed = [base] + [
        a.parent.parent / "blobs" for a in (base, *base.parents) if a.parent.name == "snapshots"
    ]
    if not any(target.is_relative_to(a) for a in allowed):
        raise ValueError(
            f"{what} file {str(p)!r} is a symbolic link to a file outside its folder {str(base)!r}; "
            f"links may only point inside the checkpoint folder (copy the file there instead)"
        )
    if not target.is_file():
        raise ValueError(f"{what} file {str(p)!r} is not a regular file; {fix}")
    return p


def read_safetensors(
    path: str | Path, *, fix: str = _RESAVE, root: str | Path | None = None
) -> dict[str, Tensor]:
    """Every tensor of the safetensors file ``path`` (on the CPU), after its header passed
    :func:`read_safetensors_header`'s checks.

    Raises:
        ValueError: the file is missing, a link out of ``root``, truncated or not a safetensors file
            (the message names it).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    read_safetensors_header(p, fix=fix, root=root)  # sizes checked before safetensors allocates anything
    try:
        return load_file(str(p))
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"weights file {str(p)!r} ({p.stat().st_size} bytes) is not a readable safetensors file "
            f"(truncated or corrupted: {e}); {fix}"
        ) from e


def read_tokenizer(path: str | Path, *, root: str | Path | None = None):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` at ``path``.

    Raises:
        ValueError: the file is missing, a link out of ``root``, larger than :data:`MAX_TOKENIZER_BYTES`
            or not a tokenizer the ``tokenizers`` library can read.
    """
    from tokenizers import Tokenizer

    fix = "save it with tokenizer.save_pretrained(DIR) (a fast tokenizer writes tokenizer.json)"
    p = confined(path, root, "tokenizer", fix)
    size = p.stat().st_size
    if size > MAX_TOKENIZER_BYTES:
        raise ValueError(
            f"tokenizer file {str(p)!r} holds {size} bytes, more than the {MAX_TOKENIZER_BYTES} read"
        )
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises its own Exception subclass for every parse failure
        raise ValueError(
            f"tokenizer file {str(p)!r} could not be read by the tokenizers library ({e}); "
            "save it again with tokenizer.save_pretrained(DIR)"
        ) from e


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


def read_safetensors_header(
    path: str | Path, *, fix: str = _RESAVE, root: str | Path | None = None
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of the safetensors file ``path``, from its header alone.

    The header (an 8-byte little-endian length, then that many bytes of JSON) is read with its length
    bounded by the file, by :data:`MAX_HEADER_BYTES` and by :data:`HEADER_FLOOR_BYTES` plus the data
    after it; its JSON is scanned before it is parsed (at most :data:`MAX_TENSORS` entries of
    :data:`MAX_DIMS` dimensions); every tensor's byte range must lie in the file and match its dtype
    and shape, so nothing it claims can make a reader allocate more than the file.

    Raises:
        ValueError: the file is missing, a link out of ``root`` (see :func:`confined`), shorter than its
            header says, or the header is not a valid safetensors header (the message names the file
            and the entry, never a number of a header that failed its checks).
    """
    header, data, bad = _raw_header(Path(path), fix, root)
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, entry in header.items():
        if name != "__metadata__":
            out[name] = _header_entry(name, entry, data, bad)
    return out


def read_safetensors_metadata(
    path: str | Path, *, fix: str = _RESAVE, root: str | Path | None = None
) -> dict[str, Any]:
    """The ``__metadata__`` object of the safetensors file ``path`` ({} when it has none).

    Raises:
        ValueError: what :func:`read_safetensors_header` raises.
    """
    header, data, bad = _raw_header(Path(path), fix, root)
    for name, entry in header.items():
        if name != "__metadata__":
            _header_entry(name, entry, data, bad)
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict):
        raise bad("__metadata__ is not an object")
    return meta


def _raw_header(
    p: Path, fix: str, root: str | Path | None
) -> tuple[dict[str, Any], int, Callable[[str], ValueError]]:
    """The header object of ``p``, the bytes of data after it, and a maker of errors naming ``p``."""
    confined(p, root, "weights", fix)
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
        if n > min(size - 8, MAX_HEADER_BYTES, HEADER_FLOOR_BYTES + size - 8 - n):
            # the length is not printed: a file that is no safetensors file would have its bytes shown
            raise bad(
                "its 8-byte header length is larger than the file, than 100 MB or than 1 MiB plus the "
                "tensor data after the header"
            )
        raw = f.read(n)
    header = parse_json(
        raw, f"the header of weights file {str(p)!r}", fix, max_values=MAX_TENSORS * (MAX_DIMS + 8)
    )
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object")
    if len(header) > MAX_TENSORS + 1:
        raise bad(f"the header holds {len(header)} entries, more than the {MAX_TENSORS} tensors read")
    return header, size - 8 - n, bad


def _header_entry(name: str, entry: Any, data: int, bad) -> tuple[torch.dtype, tuple[int, ...]]:
    """One tensor's (dtype, shape), checked against the ``data`` bytes after the header."""
    shown = repr(name[:80])
    if not isinstance(entry, dict):
        raise bad(f"entry {shown} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _SAFETENSORS_DTYPES:
        raise bad(f"tensor {shown} has a dtype that is not one of {list(_SAFETENSORS_DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"tensor {shown} has a shape that is not a list of at most {MAX_DIMS} ints >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise bad(f"tensor {shown} has data_offsets that are not [start, end] ints")
    start, end = offsets
    want = math.prod(shape) * torch.empty(0, dtype=_SAFETENSORS_DTYPES[dtype]).element_size()
    if not 0 <= start <= end <= data or end - start != want:
        raise bad(
            f"tensor {shown} ({dtype}, {len(shape)} dims) has a byte range that does not match its shape "
            f"or lies outside the {data} bytes of data"
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
