"""``auto``: which backend serves a call, and why each other one does not (:func:`explain`).

Each backend's ``why_not(problem)`` says when it cannot or should not serve a call; ``auto`` takes the first
of :data:`AUTO_ORDER` that has no objection. The problem keeps its tile grid (:meth:`Problem.grid`), so
the checks and the chosen kernel classify the mask once.
"""

from __future__ import annotations

from torch import Tensor

from ..core.biases import Bias
from ..core.masks import Mask
from ..core.problem import Problem, make_problem
from . import registry

__all__ = ["AUTO_ORDER", "choose", "explain", "first_fit"]

# The order `auto` tries the backends in; each backend's `why_not` says when it cannot or should not serve
# a call (see backends/*.py), so the first that has no objection is the fastest correct path:
#   decode  1-16 query rows against >= 128 keys: GQA folded into rows, memory-bound
#   sdpa    no mask or plain causal, small masks/biases that empty few tiles (no attention sinks)
#   tiled   masks that empty tiles, large biases, soft-capping, lse, sinks, half-precision training
#   matrix  the attention weights
# `reference` is the test oracle and is never chosen automatically; `flex` (where registered) neither.
AUTO_ORDER = ("decode", "sdpa", "tiled", "matrix")
# On CUDA the fused Triton kernel comes before `tiled` (a Python loop of small kernels there), and SDPA
# keeps only the calls its flash / cuDNN / memory-efficient kernels serve without a dense mask.
CUDA_ORDER = ("decode", "sdpa", "triton", "tiled", "matrix")


def order(p: Problem) -> tuple[str, ...]:
    """The backends auto tries for ``p``, in order: :data:`CUDA_ORDER` for CUDA tensors (those that are
    registered), :data:`AUTO_ORDER` elsewhere."""
    if p.q.device.type == "cuda":
        return tuple(name for name in CUDA_ORDER if name in registry.names())
    return AUTO_ORDER


def why_not(name: str, p: Problem) -> str | None:
    """Backend ``name``'s objection to ``p`` as auto sees it: its own ``why_not``, and on CUDA SDPA leaves
    masks and biases to the Triton kernel when that kernel can serve them."""
    reason = registry.get(name).why_not(p)
    if reason is None and name == "sdpa" and p.q.device.type == "cuda":
        reason = sdpa_leaves_to_triton(p)
    return reason


# Up to this many query rows (a decode step) SDPA keeps masks without a bias: the dense mask is only
# (Nq x Nk) and the triton kernel has no split of the keys across programs for so few rows.
CUDA_SDPA_DECODE_ROWS = 16


def sdpa_leaves_to_triton(p: Problem) -> str | None:
    """Why SDPA leaves ``p`` to the triton kernel on CUDA (None when it keeps it): a mask other than plain
    causal, or a bias, where the kernel can serve the call and it is not a decode step."""
    plain = p.bias is None and (p.mask is None or (p.mask.is_causal and p.Nq == p.Nk))
    decode = p.bias is None and p.Nq <= CUDA_SDPA_DECODE_ROWS
    if plain or decode or "triton" not in registry.names() or registry.get("triton").why_not(p) is not None:
        return None
    return (
        "on CUDA, SDPA takes this mask or bias as a dense (B, Hq, Nq, Nk) attn_mask, without its flash "
        "kernel and without skipping empty tiles; the triton kernel serves it"
    )


def first_fit(p: Problem) -> str:
    """auto's pick for ``p``: the first backend of :func:`order` that fits (what :func:`choose` picks,
    without asking the remaining backends why not - a decode step pays for every check it makes)."""
    for name in order(p):
        if why_not(name, p) is None:
            return name
    return "matrix"  # pragma: no cover - as in choose


def choose(p: Problem) -> tuple[str, dict[str, str]]:
    """Pick a backend for ``p``; return it with the reason each other backend was not taken."""
    rejected: dict[str, str] = {}
    chosen = None
    candidates = order(p)
    for name in candidates:
        reason = why_not(name, p)
        if chosen is None and reason is None:
            chosen = name
        elif reason is not None:
            rejected[name] = reason
    for name in registry.names():
        if name not in candidates and name != chosen:
            rejected[name] = registry.get(name).why_not(p) or _not_candidate(name, p)
    if chosen is None:  # pragma: no cover - `matrix` only refuses on size, `tiled` only on weights
        chosen = "matrix"
    for name in candidates:
        if name != chosen and name not in rejected:
            rejected[name] = f"fits, but '{chosen}' comes first in auto's order {list(candidates)}"
    return chosen, rejected


def _not_candidate(name: str, p: Problem) -> str:
    if name == "triton" and p.q.device.type != "cuda":
        return "auto uses the Triton kernels on CUDA only (the CPU interpreter is for tests)"
    return "not in auto's candidate list"


def explain(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Bias | Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str | registry.Backend = "auto",
    return_weights: bool = False,
    return_lse: bool = False,
    sinks: Tensor | None = None,
) -> str:
    """Say which backend ``attention(...)`` with the same arguments uses, and why the others were not.

    With a backend object (an approximation such as ``multihead.approx.TopK(64)``) it says what that
    object is and, when it cannot serve the call, why; the exact backends are not involved then.

    Raises:
        ValueError: the same as :func:`attention`, except that a backend which cannot serve the call is
            reported, not raised.
    """
    chosen = registry.resolve(backend)
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
        sinks=sinks,
    )
    lines = [f"problem: {p.describe()}"]
    if chosen is not None and not (chosen.name in registry.names() and registry.get(chosen.name) is chosen):
        kind = "backend" if getattr(chosen, "exact", True) else "approximation"
        lines.append(f"{kind} {chosen.name}: {chosen.summary}")
        reason = chosen.why_not(p)
        lines.append("  serves this call" if reason is None else f"  cannot serve this call: {reason}")
        return "\n".join(lines)
    if chosen is None:
        name, rejected = choose(p)
        lines.append(f"auto -> {name}: {registry.get(name).summary}")
    else:
        name = chosen.name
        lines.append(f"backend={name!r} requested: {registry.get(name).summary}")
        own = registry.get(name).why_not(p)
        if own is not None and name != "reference":
            lines.append(f"  warning: auto would not use {name} here: {own}")
        rejected = {n: (registry.get(n).why_not(p) or "not requested") for n in registry.names() if n != name}
    for other, why in rejected.items():
        lines.append(f"  not {other}: {why}")
    return "\n".join(lines)
