"""The mask protocol: a predicate ``allowed(b, h, q_idx, kv_idx)`` (True = may attend), its combinations
``a & b``, ``a | b``, ``~a``, and a user's bool tensor read as one.

What every mask shares lives here: the problem size a predicate is evaluated against
(:class:`MaskContext`, whose ``offset`` gives bottom-right alignment), the broadcastable index tensors
(:func:`index_grid`), the tile kinds a mask can state analytically (:data:`EMPTY` / :data:`PARTIAL` /
:data:`FULL`), printing, and the checks that a predicate's result broadcasts to ``(B, H, Nq, Nk)``.
The named masks (``causal``, ``sliding_window``, ``padding``, ...) are in :mod:`multihead.core.masks`,
which re-exports everything here.

Shape legend: B batch, H query heads, Nq queries, Nk keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "AndMask",
    "Mask",
    "MaskContext",
    "NotMask",
    "OrMask",
    "TensorMask",
    "as_mask",
    "check_broadcast",
    "check_predicate",
    "gather4",
    "index_grid",
    "kinds_from",
]


@dataclass(frozen=True)
class MaskContext:
    """The full problem size a predicate is evaluated against (needed for bottom-right alignment)."""

    B: int
    H: int
    Nq: int
    Nk: int

    @property
    def offset(self) -> int:
        """Absolute position of query row 0: ``Nk - Nq`` (bottom-right alignment)."""
        return self.Nk - self.Nq


def index_grid(
    ctx: MaskContext,
    q_range: tuple[int, int] | None = None,
    k_range: tuple[int, int] | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcastable index tensors b (B,1,1,1), h (1,H,1,1), q (1,1,nq,1), k (1,1,1,nk)."""
    q0, q1 = q_range if q_range is not None else (0, ctx.Nq)
    k0, k1 = k_range if k_range is not None else (0, ctx.Nk)
    b = torch.arange(ctx.B, device=device).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
    h = torch.arange(ctx.H, device=device).view(1, -1, 1, 1)  # (1, H, 1, 1)
    q = torch.arange(q0, q1, device=device).view(1, 1, -1, 1)  # (1, 1, nq, 1)
    k = torch.arange(k0, k1, device=device).view(1, 1, 1, -1)  # (1, 1, 1, nk)
    return b, h, q, k


# Block kinds returned by :meth:`Mask.block_kinds` (int8 codes).
EMPTY, PARTIAL, FULL = 0, 1, 2


def check_predicate(out: Tensor, target: tuple[int, ...], who: object, kind: str = "mask") -> Tensor:
    """``out`` right-aligned to 4 dims after checking it broadcasts to ``target`` (the shape of the index
    tensors it was computed from) without being broadcast itself.

    Raises:
        ValueError: naming the predicate, the shape it returned and the shape it had to broadcast to.
    """
    ok = out.dim() <= len(target) and all(
        got in (1, want) for got, want in zip(reversed(out.shape), reversed(target))
    )
    if not ok:
        name = who if isinstance(who, str) else repr(who)  # a mask's repr is only built for the message
        raise ValueError(
            f"{kind} {name} returned shape {tuple(out.shape)} for index tensors of broadcast shape "
            f"{tuple(target)}; it must broadcast to that shape (each dim equal or 1): compute it "
            "elementwise from b, h, q_idx, kv_idx, e.g. `(q_idx - kv_idx).abs() < 4`"
        )
    return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))  # (.., .., .., ..)


def kinds_from(full: Tensor, empty: Tensor) -> Tensor:
    """Encode two broadcastable bool tensors as block kinds (full wins; neither means partial)."""
    full, empty = torch.broadcast_tensors(full, empty)
    out = torch.full(full.shape, PARTIAL, dtype=torch.int8)
    return out.masked_fill_(empty, EMPTY).masked_fill_(full, FULL)


class Mask:
    """Base class: a predicate over ``(b, h, q_idx, kv_idx)``; True = may attend.

    Subclasses implement :meth:`evaluate`, which receives broadcastable index tensors (see
    :func:`index_grid`) and returns a bool tensor broadcastable to ``(b, h, q, k)``. Combine masks with
    ``a & b``, ``a | b`` and ``~a``.
    """

    #: True only for the plain causal mask (lets SDPA use its own causal kernel when Nq == Nk).
    is_causal: bool = False
    #: True when ``allowed`` depends only on ``q + offset - k`` (causal, sliding window and their
    #: combinations): every tile on one diagonal is the same, so a kernel evaluates it once.
    shift_invariant: bool = False
    #: False when the mask does not depend on the query row (padding, key padding): then the keys no
    #: query may see are read from one row (:func:`multihead.core.dead_keys.seen_keys`).
    reads_queries: bool = True
    #: False when the keys this mask hides hold the caller's own finite values (a model's KV cache,
    #: written by the model from real token ids): ``attention`` then does not zero them before a kernel
    #: runs, which would copy the cache at every decode step. A combination is cleared unless one of
    #: its parts says False.
    clear_hidden_keys: bool = True

    def evaluate(self, b: Tensor, h: Tensor, q: Tensor, k: Tensor, ctx: MaskContext) -> Tensor:
        raise NotImplementedError

    def seen_keys(self, ctx: MaskContext, device=None) -> Tensor | bool | None:
        """Which keys some query row may attend, per (batch, head), when the mask says it cheaply:
        a bool tensor broadcastable to (B, H, Nk), True when every key is seen, None when it has no
        cheap answer (the keys are then found from its tile kinds and by evaluating it block by block).
        Only called with ``ctx.Nq >= 1``.
        """
        return None

    def validate(self, ctx: MaskContext) -> None:
        """Raise ValueError when the mask cannot apply to a problem of this size."""

    def block_kinds(self, ctx: MaskContext, ql: Tensor, qh: Tensor, kl: Tensor, kh: Tensor) -> Tensor | None:
        """Classify tiles analytically, without evaluating the mask element by element.

        Tile ``(i, j)`` covers query rows ``ql[i]:qh[i]`` and keys ``kl[j]:kh[j]``; ``ql, qh`` have shape
        (nqb, 1) and ``kl, kh`` shape (1, nkb) (int64, non-empty tiles). Returns an int8 (nqb, nkb) tensor
        of :data:`EMPTY` (no (b, h, q, k) may attend: the tile is skipped), :data:`FULL` (every one may:
        no per-element mask) or :data:`PARTIAL` - or None when this mask has no analytic form (the
        kernel then evaluates it). ``PARTIAL`` is always a correct answer.
        """
        return None

    def block(
        self, ctx: MaskContext, q_range: tuple[int, int], k_range: tuple[int, int], device=None
    ) -> Tensor:
        """The mask over one tile, broadcastable to ``(B, H, q1 - q0, k1 - k0)``."""
        b, h, q, k = index_grid(ctx, q_range, k_range, device)
        out = torch.as_tensor(self.evaluate(b, h, q, k, ctx), dtype=torch.bool, device=device)
        target = (b.shape[0], h.shape[1], q.shape[2], k.shape[3])
        return check_predicate(out, target, self)  # (B|1, H|1, nq|1, nk|1)

    def natural(self, ctx: MaskContext, device=None) -> Tensor:
        """The whole mask at its natural (un-expanded) broadcast shape, e.g. ``(1, 1, Nq, Nk)``."""
        return self.block(ctx, (0, ctx.Nq), (0, ctx.Nk), device)

    def dense(self, B: int, H: int, Nq: int, Nk: int, device=None) -> Tensor:
        """Materialise the mask as a bool tensor of shape ``(B, H, Nq, Nk)``."""
        ctx = MaskContext(B, H, Nq, Nk)
        self.validate(ctx)
        return self.natural(ctx, device).expand(B, H, Nq, Nk)

    # -- composition ---------------------------------------------------------------------------
    def __and__(self, other: Mask) -> Mask:
        return AndMask(self, as_mask(other))

    def __or__(self, other: Mask) -> Mask:
        return OrMask(self, as_mask(other))

    def __invert__(self) -> Mask:
        return NotMask(self)

    # -- printing ------------------------------------------------------------------------------
    def default_size(self) -> tuple[int, int, int, int] | None:
        """(B, H, Nq, Nk) used when printing; None when any size fits (drawn at 8 x 8).

        Masks that know their size (padding, key_padding, document, tensors) override this.
        """
        return None

    def picture(self, Nq: int | None = None, Nk: int | None = None, *, batch: int = 0, head: int = 0) -> str:
        """ASCII picture of the mask for one (batch, head): ``#`` may attend, ``.`` masked."""
        B, H, dq, dk = self.default_size() or (1, 1, 8, 8)
        Nq = dq if Nq is None else Nq
        Nk = dk if Nk is None else Nk
        grid = self.dense(max(B, batch + 1), max(H, head + 1), Nq, Nk)[batch, head]
        rows = [" ".join("#" if x else "." for x in row.tolist()) for row in grid]
        return f"{self!r}  (Nq={Nq}, Nk={Nk})\n" + "\n".join(rows)

    def __str__(self) -> str:
        *_, nq, nk = self.default_size() or (1, 1, 8, 8)
        if max(nq, nk) > 48:
            return f"{self!r}  (Nq={nq}, Nk={nk}: too large to draw; use .picture(Nq, Nk))"
        return self.picture()


def as_mask(m: Mask | Tensor) -> Mask:
    """Accept a :class:`Mask` or a bool tensor broadcastable to (B, H, Nq, Nk)."""
    if isinstance(m, Mask):
        return m
    if isinstance(m, Tensor):
        return TensorMask(m)
    raise ValueError(
        f"mask must be a multihead Mask or a bool tensor, got {type(m).__name__}; "
        "build one with mh.causal(), mh.padding(lengths), ... or pass a bool tensor (True = may attend)"
    )


class AndMask(Mask):
    def __init__(self, a: Mask, b: Mask):
        self.a, self.b = a, b

    def evaluate(self, b, h, q, k, ctx):
        return self.a.evaluate(b, h, q, k, ctx) & self.b.evaluate(b, h, q, k, ctx)

    @property
    def shift_invariant(self):  # type: ignore[override]
        return self.a.shift_invariant and self.b.shift_invariant

    @property
    def reads_queries(self):  # type: ignore[override]
        return self.a.reads_queries or self.b.reads_queries

    @property
    def clear_hidden_keys(self):  # type: ignore[override]
        return self.a.clear_hidden_keys and self.b.clear_hidden_keys

    def block_kinds(self, ctx, ql, qh, kl, kh):
        ka, kb = self.a.block_kinds(ctx, ql, qh, kl, kh), self.b.block_kinds(ctx, ql, qh, kl, kh)
        if ka is None or kb is None:
            return None
        return torch.minimum(ka, kb)  # empty if either is empty, full if both are full

    def validate(self, ctx):
        self.a.validate(ctx)
        self.b.validate(ctx)

    def default_size(self):
        # Largest B and H; the largest (Nq, Nk) of a part that the whole mask accepts: padding only
        # bounds Nk from below, key_padding / document fix it, a size-1 tensor dim fits anything.
        sizes = [s for s in (self.a.default_size(), self.b.default_size()) if s is not None]
        if not sizes:
            return None
        B, H = max(s[0] for s in sizes), max(s[1] for s in sizes)
        for nq, nk in sorted({s[2:] for s in sizes}, reverse=True):
            try:
                self.validate(MaskContext(B, H, nq, nk))
            except ValueError:
                continue
            return (B, H, nq, nk)
        return sizes[0]  # parts that fit no common size: printing reports the validation error

    def __repr__(self):
        return f"({self.a!r} & {self.b!r})"


class OrMask(AndMask):
    def evaluate(self, b, h, q, k, ctx):
        return self.a.evaluate(b, h, q, k, ctx) | self.b.evaluate(b, h, q, k, ctx)

    def block_kinds(self, ctx, ql, qh, kl, kh):
        ka, kb = self.a.block_kinds(ctx, ql, qh, kl, kh), self.b.block_kinds(ctx, ql, qh, kl, kh)
        if ka is None or kb is None:
            return None
        return torch.maximum(ka, kb)  # full if either is full, empty if both are empty

    def __repr__(self):
        return f"({self.a!r} | {self.b!r})"


class NotMask(Mask):
    def __init__(self, a: Mask):
        self.a = a

    def evaluate(self, b, h, q, k, ctx):
        return ~self.a.evaluate(b, h, q, k, ctx)

    @property
    def shift_invariant(self):  # type: ignore[override]
        return self.a.shift_invariant

    @property
    def reads_queries(self):  # type: ignore[override]
        return self.a.reads_queries

    @property
    def clear_hidden_keys(self):  # type: ignore[override]
        return self.a.clear_hidden_keys

    def block_kinds(self, ctx, ql, qh, kl, kh):
        ka = self.a.block_kinds(ctx, ql, qh, kl, kh)
        return None if ka is None else FULL - ka  # empty <-> full

    def validate(self, ctx):
        self.a.validate(ctx)

    def __invert__(self) -> Mask:
        return self.a  # ~~a is a itself (keeps flags such as is_causal that let a kernel take a fast path)

    def default_size(self):
        return self.a.default_size()

    def __repr__(self):
        return f"~{self.a!r}"


def check_broadcast(t: Tensor, ctx: MaskContext, what: str) -> Tensor:
    """Right-align ``t`` to 4 dims and check it broadcasts to (B, H, Nq, Nk) without truncation."""
    want = (ctx.B, ctx.H, ctx.Nq, ctx.Nk)
    if t.dim() > 4:
        raise ValueError(
            f"{what} has {t.dim()} dims {tuple(t.shape)}; it must broadcast to (B, Hq, Nq, Nk)={want}"
        )
    t4 = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (.., .., .., ..)
    for size, full in zip(t4.shape, want):
        if size not in (1, full):
            raise ValueError(
                f"{what} of shape {tuple(t.shape)} does not broadcast to (B, Hq, Nq, Nk)={want}; "
                "each dim must equal the target or be 1"
            )
    return t4


def gather4(t4: Tensor, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """Index a 4-D tensor whose dims are full or 1 with broadcastable index tensors."""
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=b.device)
    idx = [i if size > 1 else zero for size, i in zip(t4.shape, (b, h, q, k))]
    return t4[idx[0], idx[1], idx[2], idx[3]]  # natural shape: 1 where t4 broadcasts


class TensorMask(Mask):
    """A user bool tensor broadcastable to (B, Hq, Nq, Nk); True = may attend."""

    def __init__(self, t: Tensor):
        if t.dtype != torch.bool:
            raise ValueError(
                f"a tensor passed as mask must be bool (True = may attend), got {t.dtype}; "
                "pass float scores to add as `bias=` instead"
            )
        self.t = t

    def validate(self, ctx):
        check_broadcast(self.t, ctx, "mask")

    def evaluate(self, b, h, q, k, ctx):
        t4 = check_broadcast(self.t, ctx, "mask").to(k.device)
        return gather4(t4, b, h, q, k)

    def natural(self, ctx, device=None):
        return check_broadcast(self.t, ctx, "mask").to(device)

    @property
    def reads_queries(self):  # type: ignore[override]
        return self.t.dim() >= 2 and self.t.shape[-2] > 1

    def seen_keys(self, ctx, device=None):
        return check_broadcast(self.t, ctx, "mask").any(dim=-2)  # (B|1, H|1, Nk|1)

    def default_size(self):
        return tuple((1,) * max(0, 4 - self.t.dim()) + tuple(self.t.shape))  # right-aligned (broadcast)

    def __repr__(self):
        return f"tensor_mask({tuple(self.t.shape)})"
