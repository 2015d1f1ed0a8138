"""The functional core: ``attention`` (one entry, many backends) and ``explain`` (why auto chose).

Layout (PyTorch SDPA order): q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) -> (B, Hq, Nq, Dv).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from . import backends as _backends
from .biases import Bias
from .masks import Mask
from .problem import AttentionOutput, Problem, make_problem

__all__ = ["AttentionOutput", "attention", "backends", "explain"]

# The order `auto` tries the backends in; each backend's `why_not` says when it cannot or should not serve
# a call (see backends/*.py), so the first that has no objection is the fastest correct path:
#   decode  1-16 query rows against >= 128 keys: GQA folded into rows, memory-bound
#   sdpa    no mask or plain causal, small masks/biases that empty few tiles
#   tiled   masks that empty tiles, large biases, soft-capping, lse, half-precision training
#   matrix  the attention weights
# `reference` is the test oracle and is never chosen automatically; `flex` (where registered) neither.
_AUTO_ORDER = ("decode", "sdpa", "tiled", "matrix")


def backends() -> list[str]:
    """Names of the registered backends (``"auto"`` is a policy, not a backend)."""
    return _backends.names()


def _first_fit(p: Problem) -> str:
    """auto's pick for ``p``: the first backend of ``_AUTO_ORDER`` that fits (what :func:`_choose` picks,
    without asking the remaining backends why not - a decode step pays for every check it makes)."""
    for name in _AUTO_ORDER:
        if _backends.get(name).why_not(p) is None:
            return name
    return "matrix"  # pragma: no cover - as in _choose


def _choose(p: Problem) -> tuple[str, dict[str, str]]:
    """Pick a backend for ``p``; return it with the reason each other backend was not taken."""
    rejected: dict[str, str] = {}
    chosen = None
    for name in _AUTO_ORDER:
        reason = _backends.get(name).why_not(p)
        if chosen is None and reason is None:
            chosen = name
        elif reason is not None:
            rejected[name] = reason
    for name in _backends.names():
        if name not in _AUTO_ORDER and name != chosen:
            rejected[name] = _backends.get(name).why_not(p) or "not in auto's candidate list"
    if chosen is None:  # pragma: no cover - `matrix` only refuses on size, `tiled` only on weights
        chosen = "matrix"
    for name in _AUTO_ORDER:
        if name != chosen and name not in rejected:
            rejected[name] = f"fits, but '{chosen}' comes first in auto's order {list(_AUTO_ORDER)}"
    return chosen, rejected


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Bias | Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_weights: bool = False,
    return_lse: bool = False,
    approx: Any = None,
) -> Tensor | AttentionOutput:
    """Multi-head scaled dot-product attention, ``softmax(mask(q k^T * scale + bias)) v`` (eq. 9.32).

    Args:
        q: (B, Hq, Nq, D) queries.
        k: (B, Hkv, Nk, D) keys; ``Hq % Hkv == 0`` and query head i reads kv head ``i // (Hq // Hkv)``.
        v: (B, Hkv, Nk, Dv) values.
        mask: a :class:`Mask` (``mh.causal()``, ...) or a bool tensor broadcastable to (B, Hq, Nq, Nk);
            True = may attend. Causal alignment is bottom-right.
        bias: a :class:`Bias` (``mh.alibi(Hq)``, ``mh.softcap(c)``, ...) or a float tensor broadcastable
            to (B, Hq, Nq, Nk), added to the scaled scores.
        scale: score scale, default ``1/sqrt(D)``.
        dropout_p: dropout on the attention weights, in [0, 1). Applied whenever it is > 0 (the modules
            pass 0 in eval mode).
        backend: ``"auto"`` or one of :func:`backends`.
        return_weights: also return the (B, Hq, Nq, Nk) weights (``matrix`` / ``reference`` only).
        return_lse: also return the (B, Hq, Nq) log-sum-exp of the scores (fp32; float64 for float64).
        approx: an approximation from :mod:`multihead.approx` (``TopK(k)``, ``Nystrom(m)``, ...) computed
            instead of exact attention; None (the default) is exact. It returns the output only, so it
            goes with ``backend="auto"`` and neither ``return_weights`` nor ``return_lse``.

    Returns:
        out (B, Hq, Nq, Dv) in the input dtype, or ``AttentionOutput(out, weights, lse)`` when
        ``return_weights`` or ``return_lse`` is set. A row with no allowed key gives zeros (lse = -inf).

    Raises:
        ValueError: bad shapes, dtypes, head counts, masks/biases that do not broadcast, an unknown
            backend, a backend that cannot serve the request, ``dropout_p`` outside [0, 1), an
            ``approx`` that is not an approximation or is combined with a backend or returned extras,
            and what the approximation raises for masks or biases it cannot apply.
    """
    if approx is not None:
        return _approximate(
            q, k, v, mask, bias, scale, dropout_p, backend, return_weights, return_lse, approx
        )
    p = make_problem(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=scale,
        dropout_p=dropout_p,
        return_weights=return_weights,
        return_lse=return_lse,
    )
    name = _first_fit(p) if backend == "auto" else _backends.get(backend).name
    res = _backends.get(name).run(p)
    if return_weights or return_lse:
        return res
    return res.out


def _approximate(
    q, k, v, mask, bias, scale, dropout_p, backend, return_weights, return_lse, approx
) -> Tensor:
    """``attention(..., approx=a)``: check the combination, then ``a(q, k, v, ...)``."""
    from .approx._common import check_approx  # lazy: multihead.approx builds on this module

    check_approx(approx)
    extras = [n for n, on in (("return_weights", return_weights), ("return_lse", return_lse)) if on]
    if backend != "auto" or extras:
        asked = ([f"backend={backend!r}"] if backend != "auto" else []) + [f"{n}=True" for n in extras]
        raise ValueError(
            f"approx={approx!r} computes its own attention and returns only the output, but this call also "
            f"asks for {', '.join(asked)}; drop those or drop approx"
        )
    return approx(q, k, v, mask=mask, bias=bias, scale=scale, dropout_p=dropout_p)


def explain(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Bias | Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_weights: bool = False,
    return_lse: bool = False,
) -> str:
    """Say which backend ``attention(...)`` with the same arguments uses, and why the others were not.

    Raises:
        ValueError: the same as :func:`attention`.
    """
    p = make_problem(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=scale,
        dropout_p=dropout_p,
        return_weights=return_weights,
        return_lse=return_lse,
    )
    lines = [f"problem: {p.describe()}"]
    if backend == "auto":
        name, rejected = _choose(p)
        lines.append(f"auto -> {name}: {_backends.get(name).summary}")
    else:
        name = _backends.get(backend).name
        lines.append(f"backend={name!r} requested: {_backends.get(name).summary}")
        own = _backends.get(name).why_not(p)
        if own is not None and name != "reference":
            lines.append(f"  warning: auto would not use {name} here: {own}")
        rejected = {n: (_backends.get(n).why_not(p) or "not requested") for n in backends() if n != name}
    for other, why in rejected.items():
        lines.append(f"  not {other}: {why}")
    return "\n".join(lines)
