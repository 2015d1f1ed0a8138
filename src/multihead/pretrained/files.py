"""Reading a checkpoint's files with errors that name the file, what was wrong and the fix.

A Hugging Face or sentence-transformers directory holds JSON configs, safetensors weights and a
``tokenizer.json``. Each reader here turns the parser's own exception (a ``JSONDecodeError`` with no
file name, a ``SafetensorError`` traceback, a ``UnicodeDecodeError``) into a ``ValueError`` that says
which file failed and how to get a good one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor

__all__ = ["read_json", "read_safetensors", "read_tokenizer"]

_RESAVE = "re-save it with model.save_pretrained(DIR) or download the checkpoint again"


def read_json(path: str | Path, what: str = "config") -> dict[str, Any]:
    """The JSON object in ``path``.

    Args:
        path: the file.
        what: what the file is, for the message (e.g. "config", "sharded index").

    Raises:
        ValueError: the file is missing, not UTF-8 text, not valid JSON, or not a JSON object.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} file {str(p)!r} does not exist; {_RESAVE}")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{what} file {str(p)!r} is not UTF-8 text ({e.reason} at byte {e.start}); {_RESAVE}"
        ) from e
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{what} file {str(p)!r} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
            + _RESAVE
        ) from e
    if not isinstance(obj, dict):
        kind = type(obj).__name__
        raise ValueError(f"{what} file {str(p)!r} holds a JSON {kind}, expected an object; {_RESAVE}")
    return obj


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of the safetensors file ``path`` (on the CPU).

    Raises:
        ValueError: the file is missing, truncated or not a safetensors file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"weights file {str(p)!r} does not exist; {_RESAVE}")
    try:
        return load_file(str(p))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(
            f"weights file {str(p)!r} ({p.stat().st_size} bytes) is not a readable safetensors file "
            f"(truncated or corrupted: {e}); {_RESAVE}"
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
