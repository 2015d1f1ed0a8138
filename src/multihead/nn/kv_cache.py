"""Key/value cache for incremental decoding: one layer, preallocated once, written by index (gpt-fast).

Shape legend: B batch, Hkv kv heads (only these are stored, never the repeated GQA heads), n new
positions, L positions returned, D key head dim, Dv value head dim, W sliding window.

``update`` appends the n new keys/values and returns the keys/values to attend over, in position order and
ending with the n new ones. The queries are the n new positions, so the bottom-right aligned masks of
:mod:`multihead.core.masks` apply unchanged::

    3 cached, update adds 2 -> k_all holds positions 0..4, the query rows are positions 3 and 4
                    k: 0 1 2 3 4
        causal()  q3   # # # # .
                  q4   # # # # #

Kinds:

- ``"dense"``: storage (B, Hkv, max_len, D); returns a view of the first L = length positions.
- ``"int8"``: per-token symmetric int8 K and V, ``scale = absmax / 127`` per (b, head, position), kept in
  float32 (float64 for a float64 cache) and dequantised to the cache dtype on read - mixed precision as in
  docs/equations.md, section 7 (K and V in int8, the rest in floating point). Every returned position, the
  new ones included, is the dequantised value, so results do not depend on how the tokens were chunked.
- ``"sliding"``: a ring buffer of W positions (Mistral). Returns the up to W - 1 kept positions before the
  new ones followed by the n new ones - all the earliest new token can see - so use
  ``mh.sliding_window(W)`` as the mask (for n = 1, ``mh.causal()`` gives the same result). It never
  overflows: ``max_len`` is not a limit for this kind, the oldest positions are dropped.

The cache stores values, not autograd history: writes are detached, so no gradient flows through a cached
call. Decode under ``torch.no_grad()`` / ``torch.inference_mode()``; train without a cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..core.limits import check_fits

__all__ = ["KINDS", "KVCache", "cache_bytes", "int8_rounded"]

#: The cache kinds, in the order the docs present them.
KINDS = ("dense", "sliding", "int8")

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


_SMALLER = "use a smaller batch or max_len, kind='int8' (about 1/4 of fp32), or a sliding window"


def _check_size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"KVCache {name} must be an int >= 1, got {value!r}")
    return value


def cache_bytes(
    batch_size: int,
    n_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    slots: int,
    kind: str,
    dtype: torch.dtype,
) -> int:
    """Bytes of one layer's cache storage: keys, values and (int8) their per-token scales."""
    per_token = (head_dim + v_head_dim) * (
        1 if kind == "int8" else torch.empty(0, dtype=dtype).element_size()
    )
    if kind == "int8":
        per_token += 2 * torch.empty(0, dtype=_scale_dtype(dtype)).element_size()
    return batch_size * n_kv_heads * slots * per_token


def _scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """int8 scales and the (de)quantisation arithmetic: float64 for float64 caches, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def quantize_int8(x: Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Per-token symmetric int8: x (..., D) -> q int8 (..., D) and scale (..., 1).

    ``scale = absmax(x) / 127`` over the last dim, so ``|x - q * scale| <= scale / 2``; an all-zero token
    gets scale 0 and dequantises to 0.
    """
    xf = x.detach().to(scale_dtype)  # (..., D)
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0  # (..., 1)
    q = torch.round(xf / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127).to(torch.int8)  # (..., D)
    return q, scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """q int8 (..., D) and scale (..., 1) -> (..., D) in ``dtype``, multiplied in the scale's dtype."""
    return (q.to(scale.dtype) * scale).to(dtype)


# the keys and values the "int8" caches returned, by id, while they live (a weak reference each)
_ROUNDED: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()


def int8_rounded(t: Tensor) -> bool:
    """Whether ``t`` is the very tensor of keys or values an ``"int8"`` :class:`KVCache` returned: its
    tokens already lie on their per-token int8 grid, so rounding them again would only repeat the
    arithmetic (``quantize_int8`` then ``dequantize_int8`` is the identity up to the last float bit).
    Any other tensor, a copy or a view of one included, is False."""
    return _ROUNDED.get(id(t)) is t


class KVCache(nn.Module):
    """One attention layer's key/value cache, preallocated at construction.

    Args:
        batch_size: B; every update must have exactly this batch size.
        n_kv_heads: Hkv, the key/value heads (not the query heads).
        head_dim: D of the keys.
        max_len: the most positions a ``"dense"`` or ``"int8"`` cache holds (ignored by ``"sliding"``).
        kind: ``"dense"``, ``"sliding"`` or ``"int8"`` (see the module docstring).
        window: W, required for ``kind="sliding"`` and only for it.
        dtype: dtype of the keys/values taken and returned, default ``torch.get_default_dtype()``.
        device: device of the storage.
        v_head_dim: Dv of the values, default ``head_dim``.

    Buffers are non-persistent (a cache is not part of a checkpoint) and follow ``.to()``: moving or
    casting the module moves the storage and changes ``dtype``; int8 scales stay float32 (float64).

    Raises:
        ValueError: on sizes that are not ints >= 1, an unknown kind, a missing or bad window, a window for
            a kind other than ``"sliding"``, a non-float dtype, or storage larger than the free memory.
    """

    k: Tensor
    v: Tensor
    k_scale: Tensor | None
    v_scale: Tensor | None

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        kind: str = "dense",
        window: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        v_head_dim: int | None = None,
    ):
        super().__init__()
        self.batch_size = _check_size("batch_size", batch_size)
        self.n_kv_heads = _check_size("n_kv_heads", n_kv_heads)
        self.head_dim = _check_size("head_dim", head_dim)
        self.max_len = _check_size("max_len", max_len)
        self.v_head_dim = head_dim if v_head_dim is None else _check_size("v_head_dim", v_head_dim)
        if kind not in KINDS:
            raise ValueError(f"KVCache kind must be one of {list(KINDS)}, got {kind!r}")
        if kind == "sliding":
            if window is None:
                raise ValueError("KVCache kind='sliding' needs window=W (the positions each query sees)")
            self.window: int | None = _check_size("window", window)
        elif window is not None:
            raise ValueError(
                f"KVCache window={window!r} only applies to kind='sliding', not kind={kind!r}; "
                "drop window or use kind='sliding'"
            )
        else:
            self.window = None
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in _FLOATS:
            raise ValueError(f"KVCache dtype must be float16, bfloat16, float32 or float64, got {dtype}")
        self.kind = kind
        self._dtype = dtype
        self._seen = 0  # positions appended since construction / reset
        self._allocate(device)

    def _allocate(self, device: torch.device | str | None) -> None:
        B, H, D, Dv = self.batch_size, self.n_kv_heads, self.head_dim, self.v_head_dim
        S = self.window if self.window is not None else self.max_len  # storage slots
        need = cache_bytes(B, H, D, Dv, S, self.kind, self._dtype)
        check_fits(need, f"a {self.kind} KVCache of {B} x {H} heads x {S} positions", _SMALLER, device)
        store = torch.int8 if self.kind == "int8" else self._dtype
        self.register_buffer("k", torch.zeros(B, H, S, D, dtype=store, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(B, H, S, Dv, dtype=store, device=device), persistent=False)
        int8 = self.kind == "int8"
        for name in ("k_scale", "v_scale"):  # (B, Hkv, S, 1) for int8, else None
            scale = torch.zeros(B, H, S, 1, dtype=_scale_dtype(self._dtype), device=device) if int8 else None
            self.register_buffer(name, scale, persistent=False)

    # -- state --------------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the keys/values taken by :meth:`update` and returned by it."""
        return self._dtype

    @property
    def length(self) -> int:
        """Positions held: all seen for dense/int8, ``min(seen, window)`` for sliding."""
        return self._seen if self.window is None else min(self._seen, self.window)

    @property
    def position(self) -> int:
        """Positions seen since construction or :meth:`reset`: the absolute position of the next token."""
        return self._seen

    @property
    def nbytes(self) -> int:
        """Bytes of storage (keys, values and int8 scales)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def reset(self) -> None:
        """Forget every position (the storage is kept and overwritten by later updates)."""
        self._seen = 0

    def advance(self, n: int) -> None:
        """Count n positions that a kernel wrote into the storage in place, at ``position`` ..
        ``position + n - 1`` of ``k`` and ``v`` (and, for "int8", of ``k_scale`` and ``v_scale``): what
        :meth:`update` does after its own write.

        Raises:
            ValueError: a "sliding" cache, n < 1, or more than ``max_len`` positions in all.
        """
        if self.kind == "sliding":
            raise ValueError(
                "KVCache.advance is for 'dense' and 'int8' caches written in place, this one is 'sliding'"
            )
        _check_size("n", n)
        if self._seen + n > self.max_len:
            raise ValueError(
                f"KVCache overflow: {self._seen} cached + {n} new > max_len={self.max_len}; "
                "build the cache with a larger max_len"
            )
        object.__setattr__(self, "_seen", self._seen + n)  # a plain int: nn.Module's setattr costs 5 us

    # -- update -------------------------------------------------------------------------------------------
    def update(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Append n positions and return the keys/values to attend over.

        Args:
            k_new: (B, Hkv, n, D) keys of the new positions (rotary already applied), in ``dtype``.
            v_new: (B, Hkv, n, Dv) values of the new positions, in ``dtype``.

        Returns:
            k_all (B, Hkv, L, D), v_all (B, Hkv, L, Dv) in ``dtype``, positions in order, the last n of
            them the new ones: L = ``length`` after the append for dense/int8, ``min(p, W - 1) + n`` for
            sliding with p = ``position`` before it. Dense returns views of the storage (valid until
            :meth:`reset`); int8 and sliding return new tensors.

        Raises:
            ValueError: wrong ranks, shapes, batch size, head count or head dims; a dtype or device other
                than the cache's; n = 0; or, for dense/int8, more than ``max_len`` positions in all.
        """
        n = self._check_update(k_new, v_new)
        if self.kind == "sliding":
            return self._update_sliding(k_new.detach(), v_new.detach())
        start, end = self._seen, self._seen + n
        if end > self.max_len:
            raise ValueError(
                f"KVCache overflow: {start} cached + {n} new = {end} positions > max_len={self.max_len}; "
                f"build the cache with max_len >= {end}, or use kind='sliding' with a window"
            )
        if self.k_scale is not None and self.v_scale is not None:  # int8
            sd = self.k_scale.dtype
            self.k[:, :, start:end], self.k_scale[:, :, start:end] = quantize_int8(k_new, sd)
            self.v[:, :, start:end], self.v_scale[:, :, start:end] = quantize_int8(v_new, sd)
            self._seen = end
            k_all = dequantize_int8(self.k[:, :, :end], self.k_scale[:, :, :end], self._dtype)  # (B,Hkv,L,D)
            v_all = dequantize_int8(self.v[:, :, :end], self.v_scale[:, :, :end], self._dtype)  # (B,Hkv,L,Dv)
            _ROUNDED[id(k_all)], _ROUNDED[id(v_all)] = k_all, v_all  # see int8_rounded
            return k_all, v_all
        self.k[:, :, start:end] = k_new.detach()  # (B, Hkv, n, D) written by index
        self.v[:, :, start:end] = v_new.detach()  # (B, Hkv, n, Dv)
        self._seen = end
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, Hkv, L, D), (B, Hkv, L, Dv)

    def _update_sliding(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """Ring buffer: position p lives in slot ``p % W``; gather the kept ones in order before writing."""
        assert self.window is not None
        W, n, start = self.window, k_new.shape[2], self._seen
        keep = min(start, W - 1)  # the previous positions the earliest new token still sees
        old = torch.arange(start - keep, start, device=self.k.device) % W  # (keep,) slots, oldest first
        k_all = torch.cat((self.k.index_select(2, old), k_new), dim=2)  # (B, Hkv, keep + n, D)
        v_all = torch.cat((self.v.index_select(2, old), v_new), dim=2)  # (B, Hkv, keep + n, Dv)
        tail = min(n, W)  # only the last W positions are stored
        slots = torch.arange(start + n - tail, start + n, device=self.k.device) % W  # (tail,) distinct
        self.k.index_copy_(2, slots, k_new[:, :, n - tail :])  # (B, Hkv, tail, D) written by index
        self.v.index_copy_(2, slots, v_new[:, :, n - tail :])  # (B, Hkv, tail, Dv)
        self._seen = start + n
        return k_all, v_all

    def _check_update(self, k_new: Tensor, v_new: Tensor) -> int:
        """Validate the arguments of :meth:`update` before anything is written; return n."""
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                got = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"KVCache.update {name} must be a 4-dim tensor (B, Hkv, n, D), got {got}")
            if t.dtype != self._dtype:
                raise ValueError(
                    f"KVCache.update {name} has dtype {t.dtype} but the cache holds {self._dtype}; cast with "
                    f"{name}.to({self._dtype}) or build the cache with dtype={t.dtype}"
                )
            if t.device != self.k.device:
                raise ValueError(
                    f"KVCache.update {name} is on {t.device} but the cache is on {self.k.device}; "
                    "move one of them with .to()"
                )
        n = k_new.shape[2]
        want_k = (self.batch_size, self.n_kv_heads, n, self.head_dim)
        want_v = (self.batch_size, self.n_kv_heads, n, self.v_head_dim)
        if tuple(k_new.shape) != want_k or tuple(v_new.shape) != want_v:
            raise ValueError(
                f"KVCache.update got k_new {tuple(k_new.shape)} and v_new {tuple(v_new.shape)}; this cache "
                f"takes (B, Hkv, n, D) = {want_k} and (B, Hkv, n, Dv) = {want_v} (batch_size="
                f"{self.batch_size}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"v_head_dim={self.v_head_dim})"
            )
        if n == 0:
            raise ValueError("KVCache.update needs at least one new position, got n=0")
        return n

    # -- .to() --------------------------------------------------------------------------------------------
    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> KVCache:
        # Module.to(dtype) / .half() cast every float buffer; let the cache dtype follow the same cast, and
        # keep the int8 scales in their float32 / float64 arithmetic dtype.
        self._dtype = fn(torch.empty(0, dtype=self._dtype)).dtype
        super()._apply(fn, recurse)
        sd = _scale_dtype(self._dtype)
        if self.k_scale is not None and self.v_scale is not None:
            self.k_scale, self.v_scale = self.k_scale.to(sd), self.v_scale.to(sd)
        return self

    def extra_repr(self) -> str:
        window = f", window={self.window}" if self.window is not None else ""
        return (
            f"kind={self.kind!r}{window}, batch_size={self.batch_size}, n_kv_heads={self.n_kv_heads}, "
            f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, max_len={self.max_len}, "
            f"dtype={self._dtype}, length={self.length}"
        )
