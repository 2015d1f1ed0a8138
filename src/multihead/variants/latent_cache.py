"""``LatentCache``: the KV cache of multi-head latent attention, one latent key per token.

Multi-head latent attention (DeepSeek-AI, 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model") rebuilds every head's key and value from the latent
``c_kv = RMSNorm(x W_DKV)`` (width r = kv_rank) and one decoupled rotary key ``k_R`` (width R = rope_dims)
shared by all heads. A cache therefore keeps only the latent key ``[c_kv | k_R]``: r + R numbers per token
and layer, against 2 * Hkv * D for a (grouped-query) multi-head cache.

The values of the absorbed attention are c_kv itself, the first r features of the latent key, so they are
not stored twice: :meth:`LatentCache.update` returns the stored latent keys (B, 1, L, r + R) and a view of
their first r features (B, 1, L, r) - no copy per decode step.

Shape legend: B batch, n new positions, L positions returned, r kv_rank, R rope_dims.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.checks import check_int
from ..nn.kv_cache import KVCache

__all__ = ["LatentCache"]


class LatentCache(KVCache):
    """One latent-attention layer's cache of latent keys ``[c_kv | k_R]``, preallocated at construction.

    Args:
        batch_size: B; every update must have exactly this batch size.
        kv_rank: r, width of the latent c_kv (DeepSeek ``kv_lora_rank``).
        rope_dims: R, width of the shared rotary key k_R (DeepSeek ``qk_rope_head_dim``).
        max_len: the most positions the cache holds.
        kind: ``"dense"`` only (the latent is already the compression; a sliding window or int8 storage
            of it is not implemented).
        window: must be None (no sliding kind).
        dtype, device: as :class:`~multihead.KVCache`.

    It is a :class:`~multihead.KVCache` of one kv head whose key is the latent key (storage ``k`` of
    shape (B, 1, max_len, r + R)); ``length``, ``position``, ``reset``, ``nbytes`` and ``.to()`` behave
    as there.

    Raises:
        ValueError: sizes that are not ints >= 1, a kind other than "dense", a window, a non-float dtype.
    """

    def __init__(
        self,
        batch_size: int,
        kv_rank: int,
        rope_dims: int,
        max_len: int,
        *,
        kind: str = "dense",
        window: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        self.kv_rank = check_int("kv_rank", kv_rank, 1, owner="LatentCache")
        self.rope_dims = check_int("rope_dims", rope_dims, 0, owner="LatentCache")
        if kind != "dense" or window is not None:
            raise ValueError(
                f"LatentCache supports kind='dense' without a window only, got kind={kind!r}, "
                f"window={window!r}; the latent is already the compressed cache: use kind='dense'"
            )
        super().__init__(
            batch_size, 1, kv_rank + rope_dims, max_len, dtype=dtype, device=device, v_head_dim=kv_rank
        )

    def _allocate(self, device: torch.device | str | None) -> None:
        B, W = self.batch_size, self.head_dim  # W = r + R
        self.register_buffer("k", torch.zeros(B, 1, self.max_len, W, dtype=self.dtype, device=device), False)
        self.register_buffer("k_scale", None, persistent=False)
        self.register_buffer("v_scale", None, persistent=False)

    @property
    def numbers_per_token(self) -> int:
        """Numbers one token adds: r + R."""
        return self.head_dim

    def update(self, k_new: Tensor, v_new: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Append the latent keys ``[c_kv | k_R]`` (B, 1, n, r + R) of n positions; return every cached
        position's latent key (B, 1, L, r + R) and c_kv (B, 1, L, r) (a view of its first r features),
        ending with the new ones. Both are views of the storage, valid until :meth:`reset`.

        Args:
            k_new: (B, 1, n, r + R) latent keys of the new positions (k_R already rotated), in ``dtype``.
            v_new: None or the c_kv of the new positions (B, 1, n, r) - their first r features - which
                is not stored again (only its shape is checked).

        Raises:
            ValueError: a wrong rank, shape, batch size, dtype or device; n = 0; more than ``max_len``
                positions in all.
        """
        want = (self.batch_size, 1, None, self.head_dim)
        ok = isinstance(k_new, Tensor) and k_new.dim() == 4
        if not ok or any(w is not None and s != w for s, w in zip(k_new.shape, want)) or k_new.shape[2] < 1:
            got = tuple(k_new.shape) if isinstance(k_new, Tensor) else type(k_new).__name__
            raise ValueError(
                f"LatentCache.update takes latent keys (B, 1, n, r + R) = ({self.batch_size}, 1, n >= 1, "
                f"{self.head_dim}) (kv_rank={self.kv_rank}, rope_dims={self.rope_dims}), got {got}"
            )
        if v_new is not None and tuple(v_new.shape) != (*k_new.shape[:3], self.kv_rank):
            raise ValueError(
                f"LatentCache.update v_new must be c_kv, the first kv_rank={self.kv_rank} features of the "
                f"latent keys {tuple(k_new.shape)}, got shape {tuple(v_new.shape)}"
            )
        if k_new.dtype != self.dtype or k_new.device != self.k.device:
            raise ValueError(
                f"LatentCache.update got {k_new.dtype} on {k_new.device} but the cache holds {self.dtype} on "
                f"{self.k.device}; cast with .to() or build the cache to match"
            )
        n, start = k_new.shape[2], self.position
        end = start + n
        if end > self.max_len:
            raise ValueError(
                f"LatentCache overflow: {start} cached + {n} new = {end} positions > max_len={self.max_len}; "
                f"build the cache with max_len >= {end}"
            )
        self.k[:, :, start:end] = k_new.detach()  # (B, 1, n, r + R) written by index
        self._seen = end
        k_all = self.k[:, :, :end]  # (B, 1, L, r + R)
        return k_all, k_all[..., : self.kv_rank]  # (B, 1, L, r + R), (B, 1, L, r)

    def extra_repr(self) -> str:
        return (
            f"batch_size={self.batch_size}, kv_rank={self.kv_rank}, rope_dims={self.rope_dims}, "
            f"max_len={self.max_len}, dtype={self.dtype}, length={self.length}"
        )
