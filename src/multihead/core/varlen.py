"""``varlen_attention``: attention of several sequences packed without padding (FlashAttention's
``flash_attn_varlen_func``).

The sequences lie one after another along the first dim of q (total_q, Hq, D) and of k, v (total_k, Hkv,
D / Dv); ``cu_seqlens_q`` (n + 1,) and ``cu_seqlens_k`` (n + 1,) are the cumulative lengths (0 first,
the total last), so sequence i is ``q[cu_q[i] : cu_q[i+1]]`` against ``k[cu_k[i] : cu_k[i+1]]``. No
sequence sees another's keys. With ``causal`` the mask is bottom-right aligned per sequence, as
:func:`multihead.causal` (FlashAttention >= 2.1), so a chunk of new queries against its sequence's
cached keys and new keys together is causal too::

    sequence of 2 queries and 4 keys, causal:   k: 0 1 2 3
                                             q0    # # # .
                                             q1    # # # #

Each sequence is one :func:`multihead.attention` call (B = 1) on a heads-first copy of its rows, so the
result has the bits of the call on that sequence alone; a packed kernel for the whole batch is a later step.

Shape legend: n sequences, total_q / total_k packed tokens, Hq / Hkv heads, D / Dv head dims.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import Tensor

from ..backends.registry import Backend
from .checks import as_int_tensor
from .functional import attention
from .masks import causal as causal_mask

__all__ = ["varlen_attention"]


def _check_cu(name: str, cu: object, total: int) -> list[int]:
    """The cumulative lengths as a list, after checking they start at 0, never decrease and end at total.

    Raises:
        ValueError: naming the argument, the values and the fix.
    """
    t = as_int_tensor(name, cu, owner="varlen_attention")
    if t.dim() != 1 or t.numel() < 2 or t.is_floating_point() or t.dtype == torch.bool:
        raise ValueError(
            f"varlen_attention {name} must be a 1-D integer tensor (n + 1,) of cumulative lengths, got "
            f"dtype {t.dtype} and shape {tuple(t.shape)}; e.g. [0, 5, 8] for two sequences of 5 and 3"
        )
    out = [int(x) for x in t.tolist()]
    if out[0] != 0 or out[-1] != total or any(b < a for a, b in pairwise(out)):
        raise ValueError(
            f"varlen_attention {name} must start at 0, never decrease and end at the packed length {total}, "
            f"got {out}; build it as [0, *cumsum(lengths)]"
        )
    return out


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor | list[int],
    cu_seqlens_k: Tensor | list[int],
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: str | Backend = "auto",
) -> Tensor:
    """Attention of n packed sequences: q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv)
    -> (total_q, Hq, Dv).

    Args:
        q, k, v: the sequences packed along dim 0 (no padding); GQA when Hkv < Hq (``Hq % Hkv == 0``).
        cu_seqlens_q, cu_seqlens_k: (n + 1,) cumulative lengths of the queries and of the keys.
        causal: bottom-right aligned causal mask within each sequence.
        scale, backend: as :func:`multihead.attention`.

    Returns:
        (total_q, Hq, Dv): rows of sequence i equal ``mh.attention`` of that sequence alone (B = 1), bit
        for bit; a sequence with no keys gives zeros.

    Raises:
        ValueError: tensors that are not 3-dim or do not agree in heads, dims, dtype or device; cumulative
            lengths that are not (n + 1,) ints from 0 to the packed length, never decreasing, or of
            different n for q and k; and what :func:`multihead.attention` raises.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            got = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"varlen_attention {name} must be a packed (total, H, D) tensor, got {got}; "
                "concatenate the sequences along dim 0"
            )
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"varlen_attention k {tuple(k.shape)} and v {tuple(v.shape)} must have the same total_k and Hkv"
        )
    cq = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    ck = _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(cq) != len(ck):
        raise ValueError(
            f"varlen_attention cu_seqlens_q has {len(cq) - 1} sequences but cu_seqlens_k has {len(ck) - 1}; "
            "give both the same sequences"
        )
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])  # (total_q, Hq, Dv)
    mask = causal_mask() if causal else None
    for (qa, qb), (ka, kb) in zip(pairwise(cq), pairwise(ck)):
        if qa == qb or ka == kb:
            continue  # no queries, or no keys: zeros (a row with no allowed key)
        # contiguous heads-first copies: the kernels' blocking follows the strides, and these are the
        # strides of the same sequence given alone
        qi = q[qa:qb].transpose(0, 1).contiguous()[None]  # (1, Hq, n_q, D)
        ki = k[ka:kb].transpose(0, 1).contiguous()[None]  # (1, Hkv, n_k, D)
        vi = v[ka:kb].transpose(0, 1).contiguous()[None]  # (1, Hkv, n_k, Dv)
        a = attention(qi, ki, vi, mask=mask, scale=scale, backend=backend)
        assert isinstance(a, Tensor)
        out[qa:qb] = a[0].transpose(0, 1)  # (n_q, Hq, Dv)
    return out
