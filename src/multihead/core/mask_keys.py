"""Cache keys for masks: a structural fingerprint, and which of the batch and head dims a mask reads.

A kernel that prepares something per mask (flex's block mask, a tile list) can reuse it when the same
mask comes back. :func:`mask_key` says when two masks are the same:

- predicates with a few parameters (``causal()``, ``sliding_window(w)``, ``prefix_lm(n)`` and their
  ``&``, ``|``, ``~`` combinations) are keyed by structure: two ``sliding_window(1024)`` built apart
  share a key, ``sliding_window(512)`` does not;
- masks holding tensors (``document``, ``padding``, ``key_padding``, bool tensors) are keyed by the
  tensor: its contents when it is small and on the CPU (lengths built from a list hit the cache), else
  its identity - ``id`` of the tensor owning the memory, address, shape, dtype, device and the version
  counter that every in-place edit bumps (views share it), so ``ids[5] = 3`` makes a new key. An
  identity key is only sound while the tensor is alive (a freed tensor's ``id`` and address can be
  reused): :class:`KeyedCache` checks that with weak references. Edits that bypass the version
  counter (``t.data[...] = ...``, writes through NumPy) are not seen;
- a custom predicate, or a mask class this module does not know, has no key (None): its function may
  read anything, so nothing may be reused.

:func:`mask_dims` says whether a mask depends on the batch row and on the head, so a cached object can be
built once for all rows (or heads) and broadcast.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch
from torch import Tensor

from .masks import (
    AndMask,
    Causal,
    Document,
    KeyPadding,
    Mask,
    MaskContext,
    NotMask,
    OrMask,
    Padding,
    PrefixLM,
    SlidingWindow,
    TensorMask,
)

__all__ = ["KeyedCache", "cache_key", "mask_dims", "mask_key", "mask_tensors"]

#: CPU tensors up to this many elements are keyed by their contents (cheap, and survives rebuilding).
CONTENT_KEY_NUMEL = 4096

T = TypeVar("T")


def _root(t: Tensor) -> Tensor:
    """The tensor that owns ``t``'s memory: masks keep views (``ids.unsqueeze(0)``) made afresh per mask,
    while the user's tensor is the one that lives across calls."""
    return t if t._base is None else t._base


def _tensor_key(t: Tensor) -> Hashable:
    """Contents for a small CPU tensor, else identity (owner's ``id``, address, version counter, layout)."""
    if not _identity_keyed(t):
        return ("data", t.dtype, tuple(t.shape), t.contiguous().numpy().tobytes())
    layout = (tuple(t.shape), t.stride(), t.dtype, str(t.device))
    return ("tensor", id(_root(t)), t.data_ptr(), t._version, layout)


def _identity_keyed(t: Tensor) -> bool:
    return not (t.device.type == "cpu" and t.numel() <= CONTENT_KEY_NUMEL and not t.requires_grad)


def _structure(mask: Mask) -> Hashable | None:
    """The structural key of ``mask``, or None when any part has none (exact classes only: a subclass
    may change what the predicate means)."""
    kind = type(mask)
    if kind is Causal:
        return ("causal",)
    if kind is SlidingWindow:
        return ("window", mask.size)  # type: ignore[attr-defined]
    if kind is PrefixLM:
        return ("prefix", mask.n)  # type: ignore[attr-defined]
    if kind is Padding:
        return ("padding", _tensor_key(mask.lengths))  # type: ignore[attr-defined]
    if kind is KeyPadding:
        return ("key_padding", _tensor_key(mask.mask))  # type: ignore[attr-defined]
    if kind is Document:
        return ("document", _tensor_key(mask.ids))  # type: ignore[attr-defined]
    if kind is TensorMask:
        return ("tensor_mask", _tensor_key(mask.t))  # type: ignore[attr-defined]
    if kind is NotMask:
        inner = _structure(mask.a)  # type: ignore[attr-defined]
        return None if inner is None else ("not", inner)
    if kind in (AndMask, OrMask):
        a, b = _structure(mask.a), _structure(mask.b)  # type: ignore[attr-defined]
        return None if a is None or b is None else ("and" if kind is AndMask else "or", a, b)
    return None


def mask_tensors(mask: Mask) -> list[Tensor]:
    """The tensors whose identity (not contents) is part of ``mask``'s key, for liveness checks."""
    if isinstance(mask, AndMask):  # OrMask too
        return mask_tensors(mask.a) + mask_tensors(mask.b)
    if isinstance(mask, NotMask):
        return mask_tensors(mask.a)
    held = [v for v in vars(mask).values() if isinstance(v, Tensor)]
    return [_root(t) for t in held if _identity_keyed(t)]


def mask_dims(mask: Mask, ctx: MaskContext, device: torch.device | str | None = None) -> tuple[bool, bool]:
    """``(depends_on_batch, depends_on_head)``: whether the mask can differ between batch rows / heads.

    Known classes answer from their structure (padding and key padding read the batch row, document ids
    of shape (B, N) too, a bool tensor where its batch / head dim is not 1); any other mask is evaluated
    on one (query, key) cell for every (b, h) on ``device`` (where its tensors live; default CPU) and read
    from the broadcast shape of the result. A dim of size 1 in ``ctx`` never counts as a dependency. The
    answer may be conservative (True where every row happens to be equal), never wrong the other way.
    """
    b, h = _dims(mask, ctx, device)
    return b and ctx.B > 1, h and ctx.H > 1


def _dims(mask: Mask, ctx: MaskContext, device) -> tuple[bool, bool]:
    kind = type(mask)
    if kind in (Causal, SlidingWindow, PrefixLM):
        return False, False
    if kind in (Padding, KeyPadding):
        return True, False
    if kind is Document:
        return mask.ids.shape[0] > 1, False  # type: ignore[attr-defined]
    if kind is TensorMask:
        t = mask.t  # type: ignore[attr-defined]
        shape = (1,) * max(0, 4 - t.dim()) + tuple(t.shape)  # right-aligned to (B, H, Nq, Nk)
        return shape[0] > 1, shape[1] > 1
    if kind is NotMask:
        return _dims(mask.a, ctx, device)  # type: ignore[attr-defined]
    if kind in (AndMask, OrMask):
        (ba, ha), (bb, hb) = _dims(mask.a, ctx, device), _dims(mask.b, ctx, device)  # type: ignore[attr-defined]
        return ba or bb, ha or hb
    cell = mask.block(ctx, (0, min(1, ctx.Nq)), (0, min(1, ctx.Nk)), device)  # broadcastable to (B, H, 1, 1)
    shape = (1,) * max(0, 4 - cell.dim()) + tuple(cell.shape)
    return shape[0] > 1, shape[1] > 1


def mask_key(mask: Mask, ctx: MaskContext, device: torch.device | str | None = None) -> Hashable | None:
    """A key for ``mask`` evaluated on the problem ``ctx`` on ``device``; None = do not reuse.

    Two calls get equal keys exactly when they would produce the same mask values: same structure and
    parameters (or the same, unedited tensors), same ``Nq`` and ``Nk``, the same ``B`` / ``H`` where the
    mask depends on them (see :func:`mask_dims`; otherwise that dim is None = broadcast), same device.
    Identity-keyed tensors must still be alive when a key is reused: use :class:`KeyedCache`, or check
    :func:`mask_tensors` yourself.
    """
    structure = _structure(mask)
    if structure is None:
        return None
    by_batch, by_head = mask_dims(mask, ctx)
    where = None if device is None else str(torch.device(device))
    return (structure, ctx.B if by_batch else None, ctx.H if by_head else None, ctx.Nq, ctx.Nk, where)


def cache_key(
    mask: Mask | None, ctx: MaskContext, device: torch.device | str | None = None
) -> Hashable | None:
    """:func:`mask_key`, with ``None`` for no mask keyed as ``("none", device)``."""
    if mask is None:
        return ("none", ctx.Nq, ctx.Nk, None if device is None else str(torch.device(device)))
    return mask_key(mask, ctx, device)


class KeyedCache(Generic[T]):
    """A least-recently-used cache of objects built per mask key, holding at most ``maxsize`` entries.

    Each entry remembers weak references to the mask's identity-keyed tensors; an entry whose tensors
    died is never served (a new tensor may reuse the ``id`` and address) and is evicted when met.
    ``builds`` counts the objects built, for tests and benchmarks.

    Safe to share between threads: a lock guards the entries, and threads that miss on the same key
    together build it once (the others wait for that build; builds of other keys run meanwhile).
    """

    def __init__(self, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"cache maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self.builds = 0
        self._entries: OrderedDict[Hashable, tuple[list[weakref.ref], T]] = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[Hashable, threading.Lock] = {}  # key -> held while one thread builds it

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def get(self, mask: Mask | None, ctx: MaskContext, device, build: Callable[[], T]) -> T:
        """The object cached for ``(mask, ctx, device)``, built by ``build()`` on a miss.

        A mask without a key (custom predicates) is built on every call and not stored.
        """
        key = cache_key(mask, ctx, device)
        if key is None:
            with self._lock:
                self.builds += 1
            return build()
        tensors = [] if mask is None else mask_tensors(mask)
        found = self._lookup(key, tensors)
        if found is not None:
            return found[0]
        with self._lock:
            building = self._building.setdefault(key, threading.Lock())
        with building:  # one build per key; a thread that waited here finds the entry it built
            found = self._lookup(key, tensors)
            if found is not None:
                return found[0]
            try:
                value = build()
                with self._lock:
                    self.builds += 1
                    self._entries[key] = ([weakref.ref(t) for t in tensors], value)
                    while len(self._entries) > self.maxsize:
                        self._entries.popitem(last=False)
            finally:  # stored first: a thread arriving now finds the entry, not a free build lock
                with self._lock:
                    self._building.pop(key, None)
            return value

    def _lookup(self, key: Hashable, tensors: list[Tensor]) -> tuple[T] | None:
        """``(value,)`` of a live entry for ``key`` (marked most recently used), else None (a dead
        entry is dropped)."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            refs, value = hit
            if len(refs) == len(tensors) and all(r() is t for r, t in zip(refs, tensors, strict=True)):
                self._entries.move_to_end(key)
                return (value,)
            del self._entries[key]
            return None
