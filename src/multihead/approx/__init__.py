"""Efficient approximations of attention, each a backend of the functional core and an ``nn.Module``.

An approximation is passed where a backend name goes, and returns the core's layout (output only)::

    import multihead as mh
    from multihead import approx
    out = mh.attention(q, k, v, backend=approx.Nystrom(32))  # q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D)
    out = approx.Performer(256)(q, k, v, mask=mh.causal())    # the same call -> (B, Hq, Nq, Dv)
    m = mh.MultiHeadAttention(64, 4, backend=approx.Linformer(16, 512, learned=True))  # trains with m
    lm2 = approx.apply(lm, approx.TopK(32))                   # a copy of a model, TopK in every attention
    print(mh.explain(q, k, v, mask=mh.causal(), backend=approx.Nystrom(32)))  # why it cannot serve this

They are not registered by name (they have parameters) and ``backend="auto"`` never picks one.

====================  =====================================  ========  ===============  ==========
approximation         idea                                   causal    masks / bias     cost
====================  =====================================  ========  ===============  ==========
TopK(k)               k largest scores per query             yes       any              O(N^2)
Threshold(tau)        drop weights < tau, renormalise        yes       any              O(N^2)
SparseMask(pattern)   exact attention on a sparse pattern    yes       any              O(nnz)
Linformer(k, L)       project K, V along the sequence to k   no        key padding      O(N k)
Nystrom(m)            m segment-mean landmarks               no        key padding      O(N m)
LowRank(r)            rank-r SVD of the exact weights        yes       any              O(N^2)
LinearAttention()     elu(q)+1 . elu(k)+1 kernel             yes       key padding      O(N)
Performer(F)          FAVOR+ positive random features        yes       key padding      O(N F)
====================  =====================================  ========  ===============  ==========

Patterns for :class:`SparseMask` (or any ``mask=``): :func:`local` and :func:`local_global`.
"""

from .apply import LowRankLinear, apply, low_rank_ffn
from .base import Approximation
from .linear import LinearAttention, Performer, linear_attention
from .low_rank import Linformer, LowRank, Nystrom
from .sparse import SparseMask, Threshold, TopK, local, local_global

__all__ = [
    "Approximation",
    "LinearAttention",
    "Linformer",
    "LowRank",
    "LowRankLinear",
    "Nystrom",
    "Performer",
    "SparseMask",
    "Threshold",
    "TopK",
    "apply",
    "linear_attention",
    "local",
    "local_global",
    "low_rank_ffn",
]
