"""MHA -> GQA / MQA: merge the K/V heads of each group into one (Ainslie et al., 2023, "GQA").

``method="mean"`` mean-pools the W^K / W^V rows (and biases) of the kv heads of a group, as GQA
uptraining starts from. ``method="aligned"`` first rotates each head so that the heads of a group agree,
then mean-pools ("Align Attention Heads Before Merging Them", arXiv 2412.20677):

    scores   q_i . k_i = (R q_i) . (R k_i)      for any orthogonal R: rotate W^Q_i and W^K_i rows by R
    outputs  W^O_i v_i = (W^O_i S)(S^T v_i)     for any orthogonal S: rotate W^V_i rows, W^O_i columns

so the rotated model is the same function. R and S are chosen on calibration text by generalised
orthogonal Procrustes: starting from the identity (the "mean" merge), alternate ``R_j = argmin ||K_j R_j -
M||`` (SVD of K_j^T M) and ``M = mean_j K_j R_j``. Each step lowers sum_j ||K_j R_j - M||^2, which is
the error of replacing every head's keys by the merged ones, so the aligned merge never has a larger
key (or value) merge error on the calibration tokens than the plain mean.

Rotary: q and k are rotated per position after the projection, so R must commute with every rotary
rotation: R is then block-diagonal with one 2x2 rotation per frequency pair (pairs (i, i + D/2) for
half-split rotary, (2i, 2i + 1) for interleaved), each fitted in closed form. Values are not rotated by
rotary, so S is any orthogonal matrix.

Shape legend: T calibration tokens, d width, Hq / Hkv query / kv heads before, K kv heads after,
r = Hkv // K kv heads merged into one, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..models.lm import TransformerLM
from ..nn.attention import MultiHeadAttention
from ..nn.positions import RotaryEmbedding
from ..pretrained.corpus import stdlib_docstrings
from ..pretrained.sentence_encoder import SentenceEncoder
from .access import (
    forward_ids,
    layers_of,
    model_device,
    pad_batch,
    plain_attention,
    rebuild_attention,
    to_id_lists,
)

__all__ = [
    "CALIBRATION_TEXTS",
    "calibration_inputs",
    "kv_cache_bytes_per_token",
    "procrustes",
    "rotate_heads",
    "to_gqa",
]

#: Docstrings used to align a SentenceEncoder's heads when no calibration is given.
CALIBRATION_TEXTS = 64
_ITERS = 8  # generalised Procrustes sweeps; each lowers the merge error, a handful converge


def _rotation(c: Tensor, pairs: Tensor | None) -> Tensor:
    """The orthogonal R (..., D, D) maximising tr(R^T c), i.e. minimising ||a R - b|| for c = a^T b."""
    if pairs is None:
        u, _, vh = torch.linalg.svd(c)
        return u @ vh  # (..., D, D)
    i, j = pairs[:, 0].to(c.device), pairs[:, 1].to(c.device)
    theta = torch.atan2(c[..., j, i] - c[..., i, j], c[..., i, i] + c[..., j, j])  # (..., D/2): per pair
    cos, sin = theta.cos(), theta.sin()
    r = torch.zeros_like(c)  # (..., D, D)
    r[..., i, i], r[..., j, j], r[..., i, j], r[..., j, i] = cos, cos, -sin, sin
    return r


def procrustes(a: Tensor, b: Tensor, pairs: Tensor | None = None) -> Tensor:
    """The orthogonal (D, D) ``R`` minimising ||a R - b||_F for a, b (T, D) (orthogonal Procrustes).

    Args:
        a, b: (T, D) row vectors (keys or values of two heads on the same tokens).
        pairs: None for any orthogonal R; or (D/2, 2) feature index pairs, restricting R to a rotation
            within each pair (the rotations that commute with rotary position embedding).
    """
    return _rotation(a.T @ b, pairs)


def _align(heads: Tensor, pairs: Tensor | None) -> Tensor:
    """Rotations (r, D, D) taking each head's rows heads[j] (T, D) towards their common mean.

    Generalised Procrustes from the identity: with M = mean_i K_i R_i, each K_j^T M = mean_i (K_j^T K_i)
    R_i, so one (rD x rD) Gram matrix serves every sweep and the sweeps cost only D x D work.
    """
    r, _, D = heads.shape
    rots = torch.eye(D, dtype=heads.dtype, device=heads.device).expand(r, D, D).clone()  # (r, D, D)
    if r == 1:
        return rots
    flat = heads.transpose(0, 1).reshape(-1, r * D)  # (T, r*D)
    gram = flat.T @ flat  # (r*D, r*D): block (j, i) = K_j^T K_i
    for _ in range(_ITERS):
        cross = (gram @ rots.reshape(r * D, D) / r).reshape(r, D, D)  # (r, D, D): K_j^T M
        rots = _rotation(cross, pairs)  # (r, D, D)
    return rots


def _rotary_pairs(rotary: Any, D: int) -> Tensor | None:
    """The (D/2, 2) feature pairs a rotary embedding rotates together (None without rotary).

    Raises:
        ValueError: a rotary module other than RotaryEmbedding, or one of another head dim.
    """
    if rotary is None:
        return None
    if not isinstance(rotary, RotaryEmbedding) or rotary.head_dim != D:
        raise ValueError(
            f"method='aligned' needs a RotaryEmbedding over the whole head dim {D} (to know which rotations "
            f"commute with it), got {rotary!r}; use method='mean'"
        )
    i = torch.arange(D // 2)
    return torch.stack([2 * i, 2 * i + 1] if rotary.interleaved else [i, i + D // 2], dim=1)  # (D/2, 2)


def rotate_heads(attn: MultiHeadAttention, key_rot: Tensor, value_rot: Tensor) -> None:
    """Rotate each kv head's key space by ``key_rot[j]`` and value space by ``value_rot[j]``, in place.

    ``key_rot``, ``value_rot``: (Hkv, D, D) orthogonal. The keys of kv head j and the queries of its
    query heads become ``R^T k``, ``R^T q`` (scores unchanged); its values ``S^T v`` and the W^O columns
    of its query heads ``W^O S`` (outputs unchanged). With rotary, ``key_rot`` must commute with it.
    """
    Hq, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    w, b, wo = attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight
    r = key_rot.to(w.dtype).repeat_interleave(Hq // Hkv, dim=0)  # (Hq, D, D): query head i -> kv i // G
    s = value_rot.to(w.dtype)  # (Hkv, D, D)
    rt = torch.cat([r, key_rot.to(w.dtype), s]).transpose(1, 2)  # (Hq + 2 Hkv, D, D): R^T per row block
    with torch.no_grad():
        w.copy_((rt @ w.reshape(-1, D, w.shape[1])).reshape(w.shape))  # (Hq + 2 Hkv) x (D, d) blocks
        if b is not None:
            b.copy_((rt @ b.reshape(-1, D, 1)).reshape(b.shape))  # (Hq + 2 Hkv) x (D,) blocks
        s_q = s.repeat_interleave(Hq // Hkv, dim=0)  # (Hq, D, D): the value rotation each query head reads
        o = wo.reshape(wo.shape[0], Hq, D).transpose(0, 1)  # (Hq, d, D)
        wo.copy_((o @ s_q).transpose(0, 1).reshape(wo.shape))  # (d, Hq * D)


def _merged(attn: MultiHeadAttention, K: int) -> MultiHeadAttention:
    """``attn`` with each run of r = Hkv // K kv heads replaced by their mean (weights and biases)."""
    Hq, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
    r = Hkv // K

    def pooled(t: Tensor, base: int) -> Tensor:
        heads = t[base : base + Hkv * D].reshape(K, r, D, *t.shape[1:])  # (K, r, D, ...)
        return heads.mean(1).reshape(K * D, *t.shape[1:])  # (K * D, ...)

    with torch.no_grad():
        qkv_w = torch.cat([w[: Hq * D], pooled(w, Hq * D), pooled(w, (Hq + Hkv) * D)])  # ((Hq + 2K) D, d)
        qkv_b = None if b is None else torch.cat([b[: Hq * D], pooled(b, Hq * D), pooled(b, (Hq + Hkv) * D)])
        ob = attn.o_proj.bias
        o = (attn.o_proj.weight.clone(), None if ob is None else ob.clone())
    return rebuild_attention(attn, Hq, K, (qkv_w, qkv_b), o)


@torch.no_grad()
def calibration_inputs(
    model: nn.Module, calibration: Any, batch_size: int = 16, *, what: str = "method='aligned'"
) -> list[Tensor]:
    """Each layer's self-attention input on the calibration tokens: per layer (T, d) (pads dropped).

    ``calibration``: texts (SentenceEncoder) or token ids; None: :data:`CALIBRATION_TEXTS` docstrings for a
    SentenceEncoder.

    Raises:
        ValueError: None for a model without a tokenizer, inputs :func:`to_id_lists` refuses.
    """
    if calibration is None:
        if not isinstance(model, SentenceEncoder):
            raise ValueError(
                f"{what} needs calibration inputs for a {type(model).__name__}: pass "
                "calibration=<(n, N) int tensor of token ids>"
            )
        calibration = stdlib_docstrings(CALIBRATION_TEXTS, max_chars=600)
    seqs = to_id_lists(model, calibration)
    layers = layers_of(model)
    xs: list[list[Tensor]] = [[] for _ in layers]
    real: list[Tensor] = []
    handles = [
        layer.self_attn.register_forward_pre_hook(lambda _m, args, xs=xs_l: xs.append(args[0]))
        for layer, xs_l in zip(layers, xs)
    ]
    try:
        for start in range(0, len(seqs), batch_size):
            ids, ok = pad_batch(seqs[start : start + batch_size], model_device(model))  # (B, N) each
            forward_ids(model, ids, ok)
            real.append(ok)
    finally:
        for h in handles:
            h.remove()
    return [torch.cat([x[m] for x, m in zip(xl, real)]) for xl in xs]  # (T, d) per layer


def _aligned_rotations(attn: MultiHeadAttention, x: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """Per kv head (Hkv, D, D) key and value rotations that align the heads of each merged group."""
    k, v = attn.project_keys_values(x.unsqueeze(0))  # (1, Hkv, T, D) each, before rotary
    Hkv, D = attn.n_kv_heads, attn.head_dim
    k = k[0].double().transpose(0, 1)  # (T, Hkv, D)
    v = v[0].double().transpose(0, 1)  # (T, Hkv, D)
    pairs = _rotary_pairs(attn.rotary, D)
    r = Hkv // K
    key_rot, value_rot = [], []
    for g in range(K):
        key_rot.append(_align(k[:, g * r : (g + 1) * r].transpose(0, 1), pairs))  # (r, D, D)
        value_rot.append(_align(v[:, g * r : (g + 1) * r].transpose(0, 1), None))  # (r, D, D)
    return torch.cat(key_rot), torch.cat(value_rot)  # (Hkv, D, D) each


def _check_n_kv(n_kv_heads: Any, attns: list[MultiHeadAttention]) -> int:
    for i, attn in enumerate(attns):
        Hkv = attn.n_kv_heads
        bad_type = isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int)
        if bad_type or n_kv_heads < 1 or Hkv % n_kv_heads != 0:
            ok = [k for k in range(1, Hkv + 1) if Hkv % k == 0]
            raise ValueError(
                f"n_kv_heads ({n_kv_heads!r}) must divide layer {i}'s kv heads ({Hkv}) so that each new kv "
                f"head merges whole groups; choose one of {ok}"
            )
    return int(n_kv_heads)


def to_gqa(model: nn.Module, n_kv_heads: int, method: str = "mean", *, calibration: Any = None) -> nn.Module:
    """Convert every layer's self-attention to ``n_kv_heads`` kv heads (GQA; 1 = MQA), in place.

    Args:
        model: a multihead model (copy it first with ``copy.deepcopy`` to keep the original).
        n_kv_heads: kv heads K per layer; must divide each layer's current kv heads (Hkv = Hq for MHA).
            K = Hkv leaves the model's function unchanged.
        method: "mean" (mean-pool the K/V projections of each group) or "aligned" (rotate the heads of a
            group onto each other by orthogonal Procrustes on calibration activations, then mean-pool).
        calibration: inputs for "aligned": texts (SentenceEncoder) or token ids ((n, N) int tensor, a list
            of id lists); default, for a SentenceEncoder only, :data:`CALIBRATION_TEXTS` stdlib docstrings.

    Returns:
        the model. A TransformerLM's ``n_kv_heads`` (used by ``make_cache``) is updated.

    Raises:
        ValueError: an unknown method, an n_kv_heads that does not divide every layer's kv heads, a layer
            that is not a plain MultiHeadAttention, "aligned" without calibration for a model that has no
            default, or with a rotary module it cannot commute with.
    """
    if method not in ("mean", "aligned"):
        raise ValueError(f"method must be 'mean' or 'aligned', got {method!r}")
    layers = layers_of(model)
    attns = [plain_attention(layer, i, "to_gqa") for i, layer in enumerate(layers)]
    K = _check_n_kv(n_kv_heads, attns)
    if method == "aligned":
        for attn in attns:
            _rotary_pairs(attn.rotary, attn.head_dim)  # fail before any work
        xs = calibration_inputs(model, calibration)
        for attn, x in zip(attns, xs):
            rotate_heads(attn, *_aligned_rotations(attn, x, K))
    for layer, attn in zip(layers, attns):
        layer.self_attn = _merged(attn, K)
    if isinstance(model, TransformerLM):
        model.n_kv_heads = K
    return model


def kv_cache_bytes_per_token(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes one token adds to the KV cache of every layer: sum over layers of 2 * Hkv * D * itemsize,
    or ``cache_numbers_per_token * itemsize`` for a design that says what it caches (multi-head latent
    attention: kv_rank + rope_dims).

    ``dtype`` defaults to the dtype of the model's parameters.
    """
    itemsize = (dtype or next(model.parameters()).dtype).itemsize

    def numbers(attn: nn.Module) -> int:
        own = getattr(attn, "cache_numbers_per_token", None)
        if own is not None:
            return int(own)
        return 2 * getattr(attn, "n_kv_heads", 0) * getattr(attn, "head_dim", 0)

    return sum(numbers(layer.self_attn) * itemsize for layer in layers_of(model))
