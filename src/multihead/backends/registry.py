"""The backend registry: one signature, BHSD in and out (the built-in backends register on import).

A backend is an object with a ``name``, a one-line ``summary``, ``why_not(problem) -> str | None`` (the
reason it cannot or should not serve this call, or None) and ``run(problem) -> AttentionOutput``. The
exact backends register by name; a backend object with parameters (an approximation of
:mod:`multihead.approx`, ``TopK(64)``) is passed as the object itself (:func:`resolve`) and never
registered, so ``auto`` never picks it. An object may set ``exact = False`` to say it approximates.
"""

from __future__ import annotations

from typing import Protocol, cast

from ..core.problem import AttentionOutput, Problem


class Backend(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def summary(self) -> str: ...

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


def is_backend(obj: object) -> bool:
    """True for an object with the backend protocol: str ``name`` and ``summary``, callable ``why_not`` and
    ``run`` (a registered backend, an approximation of :mod:`multihead.approx`, your own)."""
    return (
        not isinstance(obj, str)
        and isinstance(getattr(obj, "name", None), str)
        and isinstance(getattr(obj, "summary", None), str)
        and callable(getattr(obj, "why_not", None))
        and callable(getattr(obj, "run", None))
    )


def resolve(backend: object) -> Backend | None:
    """What a ``backend=`` argument asks for: None for ``"auto"`` (auto picks per call), the registered
    backend for a name, the object itself for a backend object (:func:`is_backend`).

    Raises:
        ValueError: anything else; the message names the value and lists the valid names.
    """
    if isinstance(backend, str):
        if backend == "auto":
            return None
        if backend in _REGISTRY:
            return _REGISTRY[backend]
    elif is_backend(backend):
        return cast(Backend, backend)
    valid = ", ".join(["auto", *_REGISTRY])
    raise ValueError(
        f"unknown backend {backend!r}; valid backends are: {valid}, or a backend object with name, summary, "
        "why_not(problem) and run(problem) such as multihead.approx.TopK(64)"
    )


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
    from .triton import backend as triton

    if triton.should_register():  # with CUDA and Triton, or TRITON_INTERPRET=1 on the CPU (tests)
        register(triton.BACKEND)


_register_builtins()
