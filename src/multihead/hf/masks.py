"""Hugging Face mask functions read as multihead mask predicates, never as dense (B, 1, Nq, Nk) tensors.

transformers builds every attention mask from a ``mask_function(batch_idx, head_idx, q_idx, kv_idx)``
composed out of small closures (``causal_mask_function``, ``sliding_window_overlay(w)``,
``and_masks(...)``, ``padding_mask_function(pad)``, ``packed_sequence_mask_function(ids)``, ...) and
hands it, with the query/key lengths and offsets, to the mask function registered under the model's
attention implementation. :func:`mask_interface` is that mask function for multihead: it reads the
closure tree and returns an :class:`HFMask` holding multihead predicates (``causal()``,
``sliding_window(w)``, ``key_padding``, ``document``), which the tiled kernels evaluate one tile at a time
and use to skip the tiles the mask empties. A closure it does not recognise is kept as a predicate
evaluated on absolute positions (``mh.custom``), so the result is always the mask transformers meant.

Positions: transformers numbers query row ``i`` as ``q_offset + i`` and key ``j`` as ``kv_offset + j``.
multihead's causal masks are bottom-right aligned (query row ``i`` sits at ``i + Nk - Nq``). The two agree
whenever ``q_offset - kv_offset == Nk - Nq`` (prefill, dynamic and sliding caches). A static cache pads its
keys past the prompt (``Nk`` = the cache size); a causal mask never sees those keys, so the attention
function drops them first, which brings the problem back to bottom-right alignment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..core.masks import (
    FULL,
    Causal,
    Mask,
    MaskContext,
    SlidingWindow,
    causal,
    custom,
    document,
    key_padding,
    sliding_window,
)

__all__ = ["HFMask", "describe", "mask_interface"]


# -- a small tree read out of transformers' closures ------------------------------------------------
@dataclass(frozen=True)
class Node:
    """One piece of a mask function: ``kind`` in causal | window | overlay | all | and | or | doc |
    pad | remap | fn, with its data (window size, id tensor, children, or the raw closure)."""

    kind: str
    fn: Callable | None = None
    size: int = 0
    tensor: Tensor | None = None
    children: tuple[Node, ...] = ()


def _closure(fn: Callable) -> dict[str, Any]:
    """The free variables a closure captured, by name (empty for a plain function)."""
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    except ValueError:  # an empty cell
        return {}


_OWNERS: dict[Any, str] = {}  # code object -> owner name: transformers builds fresh closures every step


def _owner(fn: Callable) -> str:
    """``'sliding_window_overlay'`` for ``sliding_window_overlay.<locals>.inner_mask``, else the name."""
    code = getattr(fn, "__code__", None)
    hit = _OWNERS.get(code) if code is not None else None
    if hit is not None:
        return hit
    qual = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", "") or ""
    if not module.startswith("transformers."):
        owner = ""
    else:
        owner = qual.split(".<locals>.")[0] if ".<locals>." in qual else qual
    if code is not None and len(_OWNERS) < 256:
        _OWNERS[code] = owner
    return owner


def parse(fn: Callable) -> Node:
    """Read a transformers mask function into a :class:`Node` tree (unknown parts become ``fn`` nodes)."""
    owner = _owner(fn)
    if owner == "causal_mask_function":
        return Node("causal", fn)
    if owner == "bidirectional_mask_function":
        return Node("all", fn)
    if not owner:
        return Node("fn", fn)
    free = _closure(fn)
    if owner == "sliding_window_overlay" and isinstance(free.get("sliding_window"), int):
        return Node("overlay", fn, size=free["sliding_window"])
    if owner == "padding_mask_function" and isinstance(free.get("padding_mask"), Tensor):
        return Node("pad", fn, tensor=free["padding_mask"])
    if owner == "packed_sequence_mask_function" and isinstance(free.get("packed_sequence_mask"), Tensor):
        return Node("doc", fn, tensor=free["packed_sequence_mask"])
    if owner == "remap_positions_for_packed_sequence" and callable(free.get("mask_function")):
        return Node("remap", fn, children=(parse(free["mask_function"]),))
    if owner in ("and_masks", "or_masks") and isinstance(free.get("mask_functions"), tuple):
        kids = tuple(parse(f) for f in free["mask_functions"])
        return _and(kids, fn) if owner == "and_masks" else _or(kids, fn)
    return Node("fn", fn)


def _flat(kind: str, kids: tuple[Node, ...]) -> list[Node]:
    out: list[Node] = []
    for k in kids:
        out.extend(k.children if k.kind == kind else (k,))
    return out


def _shift_invariant(node: Node) -> bool:
    """True when the node depends only on ``q_idx - kv_idx`` (so restarting positions change nothing
    inside one packed document)."""
    if node.kind in ("causal", "window", "overlay", "all"):
        return True
    return node.kind in ("and", "or") and all(_shift_invariant(c) for c in node.children)


def _and(kids: tuple[Node, ...], fn: Callable) -> Node:
    parts = [k for k in _flat("and", kids) if k.kind != "all"]
    kinds = [p.kind for p in parts]
    if "causal" in kinds and "overlay" in kinds:  # causal & (kv > q - w) is the sliding window
        size = min(p.size for p in parts if p.kind == "overlay")
        parts = [p for p in parts if p.kind not in ("causal", "overlay")] + [Node("window", size=size)]
    if "doc" in kinds:  # remap(f) & same-document: f on raw indices when f is shift invariant
        parts = [p.children[0] if p.kind == "remap" and _shift_invariant(p.children[0]) else p for p in parts]
        parts = [q for p in parts for q in (p.children if p.kind == "and" else (p,))]
    if not parts:
        return Node("all", fn)
    return parts[0] if len(parts) == 1 else Node("and", fn, children=tuple(parts))


def _or(kids: tuple[Node, ...], fn: Callable) -> Node:
    parts = _flat("or", kids)
    if any(p.kind == "all" for p in parts):
        return Node("all", fn)
    return parts[0] if len(parts) == 1 else Node("or", fn, children=tuple(parts))


def _bounded(node: Node) -> bool:
    """True when no query sees a key after its own position (a causal factor in a conjunction)."""
    if node.kind in ("causal", "window"):
        return True
    if node.kind == "and":
        return any(_bounded(c) for c in node.children)
    if node.kind == "or":
        return all(_bounded(c) for c in node.children)
    return False


# -- the object handed from the mask function to the attention function ----------------------------
@dataclass
class HFMask:
    """What :func:`mask_interface` returns in place of a dense mask.

    Attributes:
        mask: the multihead predicate over the kept keys (None: every key may be attended).
        keep: how many keys (from the front) any query may see; keys past it are dropped before
            attention (a static cache's unused slots).
        kv_length: the key length transformers announced.
        q_length: the query length transformers announced.
    """

    mask: Mask | None
    keep: int
    kv_length: int
    q_length: int

    # transformers sometimes inspects a mask's shape/dtype/device; answer like a (B, 1, Nq, Nk) tensor.
    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (1, 1, self.q_length, self.kv_length)

    @property
    def ndim(self) -> int:
        return 4

    def dim(self) -> int:
        return 4

    def to(self, *args, **kwargs) -> HFMask:
        return self

    def apply(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Mask | None]:
        """Drop the keys no query may see and return ``(key, value, mask)`` for ``mh.attention``.

        Raises:
            ValueError: when the keys do not have the length the mask was built for.
        """
        nk = key.shape[2]
        if nk != self.kv_length:
            raise ValueError(
                f"the multihead mask was built for kv_length={self.kv_length} keys but attention got "
                f"{nk}; build the mask and run attention under the same attn_implementation"
            )
        if self.keep < nk:
            key, value = key[:, :, : self.keep], value[:, :, : self.keep]  # (B, Hkv, keep, D)
        return key, value, self.mask

    def __repr__(self) -> str:
        return f"HFMask({self.mask!r}, keep={self.keep} of {self.kv_length} keys)"


def _absolute(fn: Callable, q_offset: int, kv_offset: int) -> Mask:
    """A transformers mask function evaluated on absolute positions, as a multihead predicate."""

    def allowed(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        out = fn(b, h, q + q_offset, k + kv_offset)
        return torch.as_tensor(out, dtype=torch.bool)

    allowed.__name__ = getattr(fn, "__qualname__", "mask_function")
    return custom(allowed)


def _lower(node: Node, aligned: bool, q_offset: int, kv_offset: int, keep: int, q_length: int) -> Mask | None:
    """Turn a node into a multihead predicate over ``keep`` keys (None = no restriction)."""
    kind = node.kind
    if kind == "all":
        return None
    if kind == "causal" and aligned:
        return causal()
    if kind == "window" and aligned:
        return sliding_window(node.size)
    if kind == "window":  # causal & overlay(w) on absolute positions
        w = node.size
        return custom(lambda b, h, q, k: (k + kv_offset <= q + q_offset) & (k + kv_offset > q + q_offset - w))
    if kind == "pad" and node.tensor is not None and node.tensor.dim() == 2:
        pad = node.tensor.bool()
        if pad.shape[1] >= kv_offset + keep:
            return key_padding(pad[:, kv_offset : kv_offset + keep])
    if kind == "doc" and node.tensor is not None and q_offset == kv_offset == 0:
        ids = node.tensor
        if ids.dim() == 2 and ids.shape[1] == keep == q_length:
            return document(ids)
    if kind in ("and", "or"):
        parts = [_lower(c, aligned, q_offset, kv_offset, keep, q_length) for c in node.children]
        if kind == "or" and any(p is None for p in parts):
            return None
        kept = [p for p in parts if p is not None]
        if not kept:
            return None
        out = kept[0]
        for p in kept[1:]:
            out = (out & p) if kind == "and" else (out | p)
        return out
    if node.fn is None:
        raise ValueError(f"cannot evaluate the mask piece {node.kind!r}: it carries no function")
    return _absolute(node.fn, q_offset, kv_offset)


def _causal_positions(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
    return k <= q


def _int(x: int | Tensor) -> int:
    return int(x.item()) if isinstance(x, Tensor) else int(x)


def mask_interface(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int | Tensor = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    **kwargs,
) -> HFMask:
    """The mask function multihead registers with ``transformers.AttentionMaskInterface``.

    Args:
        batch_size: B.
        q_length: Nq, the number of query rows of this forward.
        kv_length: Nk, the number of keys attention will get (a static cache's full size).
        q_offset: absolute position of query row 0.
        kv_offset: absolute position of key 0.
        mask_function: the composed transformers predicate ``fn(batch_idx, head_idx, q_idx, kv_idx)``;
            None means causal.
        attention_mask: optional (B, n) 2-D padding mask, True/1 = real token, over absolute positions.
        **kwargs: the other arguments transformers passes (dtype, config, use_vmap, ...), unused.

    Returns:
        An :class:`HFMask` that the multihead attention function reads.
    """
    if isinstance(attention_mask, HFMask):  # built ahead of the forward (generate with a static cache)
        return attention_mask
    q_offset, kv_offset = _int(q_offset), _int(kv_offset)
    node = parse(mask_function) if mask_function is not None else Node("causal", _causal_positions)
    if attention_mask is not None and attention_mask.dim() == 2:
        pad = attention_mask.bool()
        need = kv_offset + kv_length
        if pad.shape[1] < need:  # transformers pads the 2-D mask with False (keys not written yet)
            pad = torch.nn.functional.pad(pad, (0, need - pad.shape[1]))
        if not bool(pad[:, kv_offset:need].all()):
            node = _and((node, Node("pad", tensor=pad)), lambda *a: None)
    elif attention_mask is not None:
        raise ValueError(
            f"attention_mask given to the multihead mask function must be a (B, n) 2-D padding mask, got "
            f"shape {tuple(attention_mask.shape)}; pass 4-D masks straight to the model instead"
        )
    keep = kv_length
    if _bounded(node):  # no query sees past its own position: drop the keys after the last query
        keep = max(0, min(kv_length, q_offset + q_length - kv_offset))
    aligned = q_offset - kv_offset == keep - q_length
    mask = _lower(node, aligned, q_offset, kv_offset, keep, q_length)
    if mask is not None and _everywhere(mask, batch_size, q_length, keep):
        mask = None  # e.g. a decode step inside the window: the kernels' unmasked fast path
    return HFMask(mask, keep, kv_length, q_length)


def _everywhere(mask: Mask, B: int, nq: int, nk: int) -> bool:
    """True when ``mask`` provably lets every query see every key (one tile, classified analytically)."""
    if nq == 0 or nk == 0:
        return False
    if type(mask) is Causal:  # bottom-right: a single row sees every key (the usual decode step)
        return nq == 1
    if type(mask) is SlidingWindow:
        return nq == 1 and nk <= mask.size
    one = torch.zeros(1, 1, dtype=torch.long)
    kinds = mask.block_kinds(MaskContext(B, 1, nq, nk), one, one + nq, one, one + nk)
    return kinds is not None and int(kinds.min()) == FULL


def describe(mask_function: Callable) -> str:
    """A one-line reading of a transformers mask function, e.g. ``and(window(4096), doc)`` (for logs)."""

    def show(n: Node) -> str:
        if n.kind in ("and", "or"):
            return f"{n.kind}({', '.join(show(c) for c in n.children)})"
        if n.kind in ("window", "overlay"):
            return f"{n.kind}({n.size})"
        if n.kind == "fn":
            return f"fn({getattr(n.fn, '__qualname__', '?')})"
        return n.kind

    return show(parse(mask_function))
