"""Attention over a paged KV cache, in torch: the reference the native and Triton kernels will be held to.

The call is FlashAttention's ``flash_attn_with_kvcache`` with a block table: every row b of the batch
has its own length ``seq_lens[b]`` and its own blocks ``block_tables[b]``; its ``Nq`` queries are the
last Nq positions of that sequence, so causal alignment is bottom-right per row::

    row 0: L = 5, Nq = 2          row 1: L = 3, Nq = 2 (padded to 5 keys in the batched call)
          k: 0 1 2 3 4                  k: 0 1 2 . .
        q3   # # # # .                q1   # # . . .
        q4   # # # # #                q2   # # # . .

:func:`paged_attention` gathers each row's keys and values in position order and calls
:func:`multihead.attention` on that row alone: the very call a dense :class:`~multihead.KVCache` of that
sequence makes, so the result has the same bits. :func:`paged_attention_batched` is one call for the
whole batch, keys padded to the longest row and masked (same result within the numerics rule).

Shape legend: B rows, Hq query heads, Hkv kv heads, Nq queries per row, D / Dv head dims, bs block size,
nb blocks per row in the table, Lmax the longest row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.functional import attention
from ..core.masks import Mask, causal, padding
from ..nn.kv_cache import dequantize_int8

__all__ = ["paged_attention", "paged_attention_batched", "paged_slots", "read_pages"]


def paged_slots(block_tables: Tensor, seq_lens: Tensor, block_size: int) -> Tensor:
    """Flat slots (B, Lmax) of every row's positions 0 .. Lmax - 1; past a row's length they point at
    slot 0 (any valid slot: those keys are masked).

    Raises:
        ValueError: block tables too short for the lengths.
    """
    B, nb = block_tables.shape
    lmax = int(seq_lens.max()) if B else 0
    if lmax > nb * block_size:
        raise ValueError(
            f"block_tables of {nb} blocks x block_size {block_size} hold {nb * block_size} positions, but "
            f"seq_lens reach {lmax}; give each row ceil(length / block_size) blocks"
        )
    pos = torch.arange(lmax, device=block_tables.device)  # (Lmax,)
    blocks = block_tables.long()[:, pos // block_size]  # (B, Lmax)
    slots = blocks * block_size + pos % block_size  # (B, Lmax)
    return torch.where(pos < seq_lens[:, None].to(pos.device), slots, 0)  # (B, Lmax)


def read_pages(
    pool: Tensor, slots: Tensor, scale: Tensor | None = None, dtype: torch.dtype | None = None
) -> Tensor:
    """Tokens of a pool (num_blocks, bs, Hkv, D) at flat ``slots`` (...) -> (..., Hkv, D); an int8 pool
    with its ``scale`` (num_blocks, bs, Hkv, 1) dequantised to ``dtype``."""
    flat = pool.reshape(-1, *pool.shape[2:])  # (S, Hkv, D)
    if scale is None:
        return flat[slots]  # (..., Hkv, D)
    assert dtype is not None, "an int8 pool needs the dtype to dequantise to"
    return dequantize_int8(flat[slots], scale.reshape(-1, *scale.shape[2:])[slots], dtype)  # (..., Hkv, D)


def _check(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, seq_lens: Tensor) -> None:
    """Raise ValueError on shapes that do not fit together."""
    if q.dim() != 4 or k_pool.dim() != 4 or v_pool.dim() != 4:
        raise ValueError(
            f"paged attention takes q (B, Hq, Nq, D) and pools (num_blocks, bs, Hkv, D), got q "
            f"{tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}"
        )
    B, Nq = q.shape[0], q.shape[2]
    if tuple(block_tables.shape[:1]) != (B,) or block_tables.dim() != 2 or tuple(seq_lens.shape) != (B,):
        raise ValueError(
            f"block_tables must be (B, nb) and seq_lens (B,) with B = {B} (q's batch), got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    if B and int(seq_lens.min()) < Nq:
        raise ValueError(
            f"every row must hold at least its Nq={Nq} queries' positions, got seq_lens {seq_lens.tolist()}"
        )


def paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    *,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Each row's queries against its own pages, one :func:`multihead.attention` call per row.

    Args:
        q: (B, Hq, Nq, D), the last Nq positions of each row (already in its sequence's length).
        k_pool: (num_blocks, bs, Hkv, D) keys; int8 with ``k_scale`` (num_blocks, bs, Hkv, 1).
        v_pool: (num_blocks, bs, Hkv, Dv) values; int8 with ``v_scale``.
        block_tables: (B, nb) int block ids of each row, in position order.
        seq_lens: (B,) int tokens each row holds (its queries included).
        scale, backend: as :func:`multihead.attention`.

    Returns:
        (B, Hq, Nq, Dv) in q's dtype: row b equals ``mh.attention(q[b:b+1], K_b, V_b, mask=mh.causal())``
        with K_b, V_b the row's keys and values in position order, bit for bit.

    Raises:
        ValueError: shapes that do not fit, a row shorter than Nq, block tables too short.
    """
    _check(q, k_pool, v_pool, block_tables, seq_lens)
    bs = k_pool.shape[1]
    out = []
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        slots = paged_slots(block_tables[b : b + 1], seq_lens[b : b + 1], bs)[0]  # (L,)
        k = read_pages(k_pool, slots, k_scale, q.dtype).transpose(0, 1).contiguous()  # (Hkv, L, D)
        v = read_pages(v_pool, slots, v_scale, q.dtype).transpose(0, 1).contiguous()  # (Hkv, L, Dv)
        assert k.shape[1] == n
        a = attention(q[b : b + 1], k[None], v[None], mask=causal(), scale=scale, backend=backend)
        assert isinstance(a, Tensor)
        out.append(a)  # (1, Hq, Nq, Dv)
    return torch.cat(out)  # (B, Hq, Nq, Dv)


def paged_attention_batched(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    *,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """:func:`paged_attention` as one call: every row's keys gathered into (B, Hkv, Lmax, D), the padding
    masked (``mh.padding`` for Nq = 1, a per-row causal mask otherwise). Arguments and result as
    :func:`paged_attention`, equal within the numerics rule.

    Raises:
        ValueError: as :func:`paged_attention`.
    """
    _check(q, k_pool, v_pool, block_tables, seq_lens)
    slots = paged_slots(block_tables, seq_lens, k_pool.shape[1])  # (B, Lmax)
    k = read_pages(k_pool, slots, k_scale, q.dtype).permute(0, 2, 1, 3)  # (B, Hkv, Lmax, D)
    v = read_pages(v_pool, slots, v_scale, q.dtype).permute(0, 2, 1, 3)  # (B, Hkv, Lmax, Dv)
    a = attention(q, k, v, mask=rows_mask(seq_lens, q.shape[2], k.shape[2]), scale=scale, backend=backend)
    assert isinstance(a, Tensor)
    return a  # (B, Hq, Nq, Dv)


def rows_mask(seq_lens: Tensor, n_q: int, n_k: int) -> Mask | Tensor:
    """The mask of a batch whose row b holds ``seq_lens[b]`` keys padded to n_k and whose n_q queries are
    its last positions: ``mh.padding`` when n_q = 1, else a bool (B, 1, n_q, n_k) tensor."""
    if n_q == 1:
        return padding(seq_lens)
    kpos = torch.arange(n_k, device=seq_lens.device)  # (n_k,)
    qpos = seq_lens[:, None] - n_q + torch.arange(n_q, device=seq_lens.device)  # (B, n_q) absolute
    return (kpos[None, None, :] <= qpos[:, :, None])[:, None]  # (B, 1, n_q, n_k)
