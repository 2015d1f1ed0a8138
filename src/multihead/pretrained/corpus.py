"""A text corpus every Python has: the docstrings of the standard library.

Used by the parity tests, the benchmarks, the study and ``multihead encode`` as real, varied English text
(one line to a few hundred tokens) that needs no download.
"""

from __future__ import annotations

import importlib
import inspect

__all__ = ["STDLIB_MODULES", "stdlib_docstrings"]

#: Modules whose functions, classes and methods give the docstrings, in this order.
STDLIB_MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fnmatch",
    "fractions", "ftplib", "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client",
    "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "logging", "math", "mimetypes",
    "operator", "os", "pathlib", "pickle", "platform", "pprint", "queue", "random", "re", "secrets",
    "shlex", "shutil", "smtplib", "socket", "statistics", "string", "struct", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "time", "timeit", "tokenize", "traceback", "typing", "unittest",
    "urllib.parse", "uuid", "warnings", "weakref", "zipfile",
)  # fmt: skip


def _members(module) -> list[object]:
    """Public functions and classes of a module, then the public methods of those classes, by name."""
    out: list[object] = []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            out.append(obj)
        if inspect.isclass(obj):
            out += [
                m for n, m in sorted(vars(obj).items()) if not n.startswith("_") and inspect.isfunction(m)
            ]
    return out


def stdlib_docstrings(n: int | None = None, *, min_chars: int = 1, max_chars: int | None = None) -> list[str]:
    """Up to ``n`` distinct docstrings of the standard library, in a fixed order (all of them for None),
    of ``min_chars`` to ``max_chars`` characters.

    The texts depend on the Python version, never on the run: the same interpreter gives the same list.

    Raises:
        ValueError: if ``n`` is not None or an int >= 1.
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be None or an int >= 1, got {n!r}")
    seen: set[str] = set()
    docs: list[str] = []
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a Python built without this module (e.g. no ssl): skip it
            continue
        for obj in _members(module):
            doc = inspect.getdoc(obj)
            if doc is None:
                continue
            fits = bool(doc) and len(doc) >= min_chars and (max_chars is None or len(doc) <= max_chars)
            if fits and doc not in seen:
                seen.add(doc)
                docs.append(doc)
                if n is not None and len(docs) == n:
                    return docs
    return docs
