"""The backend registry: one signature, BHSD in and out (the built-in backends register on import).

A backend is an object with a ``name``, a one-line ``summary``, ``why_not(problem) -> str | None`` (the
reason it cannot or should not serve this call, or None) and ``run(problem) -> AttentionOutput``.
"""

from __future__ import annotations

from typing import Protocol

from ..core.problem import AttentionOutput, Problem


class Backend(Protocol):
    name: str
    summary: str

    def why_not(self, p: Problem) -> str | None: ...

    def run(self, p: Problem) -> AttentionOutput: ...


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add a backend to the registry (a later one with the same name replaces the earlier)."""
    _REGISTRY[backend.name] = backend
    return backend


def get(name: str) -> Backend:
    """Look a backend up by name.

    Raises:
        ValueError: if no backend has that name (the message lists the valid ones).
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        valid = ", ".join(["auto", *_REGISTRY])
        raise ValueError(f"unknown backend {name!r}; valid backends are: {valid}")
    return _REGISTRY[name]


def names() -> list[str]:
    """Registered backend names, in registration order."""
    return list(_REGISTRY)


def _register_builtins() -> None:
    from . import decode, matrix, reference, sdpa
    from .tiled import backend as tiled

    for mod in (reference, matrix, sdpa, tiled, decode):
        register(mod.BACKEND)
    from . import flex

    if flex.should_register():  # optional: with CUDA, or MULTIHEAD_FLEX=1 (it compiles per shape)
        register(flex.BACKEND)


_register_builtins()
