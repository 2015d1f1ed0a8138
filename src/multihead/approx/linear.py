"""Linear attention: replace exp(q.k) by a feature-map product, O(N) time and memory.

With a positive feature map phi, ``sim(q, k) = phi(q) . phi(k)`` and the attention sums regroup:

    out_i = sum_j sim(q_i, k_j) v_j / sum_j sim(q_i, k_j)
          = phi(q_i)^T (sum_j phi(k_j) v_j^T) / phi(q_i)^T (sum_j phi(k_j))      (Katharopoulos et al. 2020)

so the (F x Dv) state ``S = phi(K)^T V`` and the F-vector ``z = phi(K)^T 1`` replace the N x N matrix.
The causal form takes prefix sums of S and z. Here it is chunked: within a chunk of C positions the
masked quadratic form, across chunks the running state (an exclusive cumulative sum of per-chunk states),
so memory is O(N C + (N / C) F Dv) instead of the O(N F Dv) of a position-by-position prefix sum.

    LinearAttention(feature_map="elu"):  phi(x) = elu(x) + 1, a kernel with no temperature
    Performer(features):                 FAVOR+ (Choromanski et al. 2021):
                                         phi(x) = exp(W x - |x|^2 / 2) / sqrt(F)
                                         with orthogonal Gaussian rows W, so E[phi(q).phi(k)] = exp(q.k);
                                         features in fp32 (fp16 would overflow exp)

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Nq queries, Nk keys, D head dim,
Dv value head dim, F features, C chunk length, n chunks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.checks import check_int
from ..core.problem import Problem
from .base import Approximation

__all__ = ["LinearAttention", "Performer", "linear_attention"]

CHUNK = 64  #: positions per chunk of the causal form


def _divide(num: Tensor, den: Tensor) -> Tensor:
    """num (..., Dv) / den (...,), zeros where the denominator is 0 (no key seen)."""
    den = den.unsqueeze(-1)
    return num / torch.where(den > 0, den, torch.ones_like(den))


def _causal_diagonal(fq: Tensor, fk: Tensor, v: Tensor, state: Tensor, zsum: Tensor, chunk: int) -> Tensor:
    """Causal linear attention where query i sees keys 0..i, after a prefix with state ``state``, ``zsum``.

    fq (B, Hkv, G, N, F), fk (B, Hkv, 1, N, F), v (B, Hkv, 1, N, Dv), state (B, Hkv, 1, F, Dv),
    zsum (B, Hkv, 1, F) -> (B, Hkv, G, N, Dv).
    """
    N = fq.shape[-2]
    pad = -N % chunk
    if pad:  # zero features add nothing to any sum; padded query rows are dropped below
        fq, fk, v = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, v))
    n = (N + pad) // chunk
    qc = fq.unflatten(-2, (n, chunk))  # (B, Hkv, G, n, C, F)
    kc = fk.unflatten(-2, (n, chunk))  # (B, Hkv, 1, n, C, F)
    vc = v.unflatten(-2, (n, chunk))  # (B, Hkv, 1, n, C, Dv)
    chunk_state = kc.transpose(-1, -2) @ vc  # (B, Hkv, 1, n, F, Dv)
    before = state.unsqueeze(-3) + chunk_state.cumsum(-3) - chunk_state  # (B, Hkv, 1, n, F, Dv): exclusive
    z_before = zsum.unsqueeze(-2) + kc.sum(-2).cumsum(-2) - kc.sum(-2)  # (B, Hkv, 1, n, F)
    tril = torch.ones(chunk, chunk, dtype=torch.bool, device=fq.device).tril()
    sim = (qc @ kc.transpose(-1, -2)) * tril  # (B, Hkv, G, n, C, C): within the chunk, j <= i
    num = sim @ vc + qc @ before  # (B, Hkv, G, n, C, Dv)
    den = sim.sum(-1) + (qc @ z_before.unsqueeze(-1)).squeeze(-1)  # (B, Hkv, G, n, C)
    return _divide(num, den).flatten(-3, -2)[..., :N, :]  # (B, Hkv, G, N, Dv)


def linear_attention(
    fq: Tensor, fk: Tensor, v: Tensor, *, causal: bool = False, chunk: int = CHUNK
) -> Tensor:
    """Attention with similarity ``fq . fk`` (non-negative features), in O(N) time and memory.

    Args:
        fq: (B, Hq, Nq, F) query features.
        fk: (B, Hkv, Nk, F) key features (zero rows for padded keys).
        v: (B, Hkv, Nk, Dv) values.
        causal: bottom-right causal: query i sees keys ``j <= i + Nk - Nq`` (rows that see no key: zeros).
        chunk: chunk length C of the causal form.

    Returns:
        (B, Hq, Nq, Dv).
    """
    B, Hq, Nq, Fd = fq.shape
    Hkv, Nk, Dv = fk.shape[1], fk.shape[2], v.shape[-1]
    q5 = fq.view(B, Hkv, Hq // Hkv, Nq, Fd)  # (B, Hkv, G, Nq, F)
    k5, v5 = fk[:, :, None], v[:, :, None]  # (B, Hkv, 1, Nk, F), (B, Hkv, 1, Nk, Dv)
    if not causal:
        state = k5.transpose(-1, -2) @ v5  # (B, Hkv, 1, F, Dv)
        out = _divide(q5 @ state, (q5 @ k5.sum(-2).unsqueeze(-1)).squeeze(-1))  # (B, Hkv, G, Nq, Dv)
        return out.reshape(B, Hq, Nq, Dv)
    off = Nk - Nq  # bottom-right: query i sits at absolute position i + off
    if off >= 0:  # keys before the first query's position are seen by every query: a prefix state
        state = k5[..., :off, :].transpose(-1, -2) @ v5[..., :off, :]  # (B, Hkv, 1, F, Dv)
        out = _causal_diagonal(q5, k5[..., off:, :], v5[..., off:, :], state, k5[..., :off, :].sum(-2), chunk)
    else:  # the first -off query rows come before every key: zeros
        state = fk.new_zeros(B, Hkv, 1, Fd, Dv)
        seen = _causal_diagonal(q5[..., -off:, :], k5, v5, state, fk.new_zeros(B, Hkv, 1, Fd), chunk)
        out = torch.cat((seen.new_zeros(B, Hkv, q5.shape[2], -off, Dv), seen), dim=-2)
    return out.reshape(B, Hq, Nq, Dv)  # (B, Hq, Nq, Dv)


class _FeatureAttention(Approximation):
    supports_causal = True
    #: positions per chunk of the causal form (memory O(N C); every chunk length gives the same result)
    chunk: int = CHUNK

    def features(self, x: Tensor, p: Problem, is_query: bool) -> Tensor:
        raise NotImplementedError

    def attend(self, p: Problem) -> Tensor:
        parts = self.split(p)
        fq = self.features(p.q, p, True)  # (B, Hq, Nq, F)
        fk = self.features(p.k, p, False)  # (B, Hkv, Nk, F)
        if parts.keys is not None:
            fk = fk * parts.keys.transpose(-1, -2).to(fk.dtype)  # (B, Hkv, Nk, F): padded keys -> 0
        return linear_attention(fq, fk, p.v, causal=parts.causal, chunk=self.chunk)


class LinearAttention(_FeatureAttention):
    """Linear attention of Katharopoulos et al. (2020): ``sim(q, k) = phi(q) . phi(k)``, O(N).

    Args:
        feature_map: ``"elu"`` (phi(x) = elu(x) + 1, the paper's) or ``"relu"`` (phi(x) = relu(x); a row
            whose features are all zero attends to nothing and returns zeros).

    ``scale`` must be left None (or be the default ``1/sqrt(D)``, which is ignored): these kernels have no
    temperature (scale the inputs instead).

    Raises:
        ValueError: an unknown feature map; at call time a ``scale`` other than the default.
    """

    summary = "softmax replaced by a feature-map kernel phi(q).phi(k), regrouped to O(N) time and memory"

    def __init__(self, feature_map: str = "elu"):
        super().__init__()
        if feature_map not in ("elu", "relu"):
            raise ValueError(f"LinearAttention feature_map must be 'elu' or 'relu', got {feature_map!r}")
        self.feature_map = feature_map

    def arguments(self) -> list[str]:
        return [] if self.feature_map == "elu" else [repr(self.feature_map)]

    def why_not(self, p: Problem) -> str | None:
        reason = super().why_not(p)
        if reason is None and p.scale != 1.0 / math.sqrt(p.D):  # the default scale is what make_problem set
            reason = (
                f"LinearAttention's kernel {self.feature_map}(q).{self.feature_map}(k) has no temperature, "
                f"got scale={p.scale!r}; pass scale=None (or use Performer, which approximates "
                "exp(q.k*scale))"
            )
        return reason

    def features(self, x: Tensor, p: Problem, is_query: bool) -> Tensor:
        return F.elu(x) + 1 if self.feature_map == "elu" else F.relu(x)

    def extra_repr(self) -> str:
        return f"feature_map={self.feature_map!r}"


def _orthogonal_gaussian(features: int, dim: int, g: torch.Generator, orthogonal: bool) -> Tensor:
    """(features, dim) rows with N(0, I) marginals; orthogonal within blocks of ``dim`` rows."""
    if not orthogonal:
        return torch.randn(features, dim, generator=g, dtype=torch.float64)
    n = math.ceil(features / dim)
    # one draw per block, in the order a loop over blocks takes them (the generator's stream is unchanged),
    # then one batched QR: thousands of tiny QR calls took seconds
    gauss = torch.stack(
        [torch.randn(dim, dim, generator=g, dtype=torch.float64) for _ in range(n)]
    )  # (n, dim, dim)
    qm, r = torch.linalg.qr(gauss)  # (n, dim, dim) each
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # (n, 1, dim)
    blocks = (qm * signs).transpose(-1, -2)  # (n, dim, dim) sign fix: Haar-distributed, uniform rows
    w = blocks.reshape(n * dim, dim)[:features]  # (features, dim) unit rows
    norms = torch.randn(features, dim, generator=g, dtype=torch.float64).norm(dim=1, keepdim=True)  # chi(dim)
    return w * norms


class Performer(_FeatureAttention):
    """Performer's FAVOR+ (Choromanski et al. 2021): positive random features for the softmax kernel.

    ``phi(x) = exp(W x' - |x'|^2 / 2 - c) / sqrt(F)`` with ``x' = x * sqrt(scale)`` and W (F x D) random
    Gaussian rows, so ``E[phi(q) . phi(k)] = exp(q . k * scale)`` (unbiased); the stabiliser c (per query
    row, per head for keys) cancels between numerator and denominator. The projection is drawn once per
    head dim from ``seed`` (deterministic, float64, cast to the working dtype), features are computed in
    fp32 for half inputs.

    Args:
        features: F random features, an int >= 1 (the error falls like 1/sqrt(F)).
        orthogonal: orthogonal blocks of rows (lower variance, still unbiased), as in the paper.
        seed: seed of the random projection.

    Raises:
        ValueError: ``features`` not an int >= 1.
    """

    summary = "FAVOR+ positive random features for the softmax kernel (O(N F) time and memory)"

    def __init__(self, features: int = 256, *, orthogonal: bool = True, seed: int = 0):
        super().__init__()
        self.n_features = check_int("features", features, 1, owner="Performer")
        self.orthogonal, self.seed = bool(orthogonal), seed
        self._proj: dict[int, Tensor] = {}

    def projection(self, dim: int) -> Tensor:
        """The (F, dim) float64 random matrix W used for head dim ``dim``."""
        if dim not in self._proj:
            g = torch.Generator().manual_seed(self.seed)
            self._proj[dim] = _orthogonal_gaussian(self.n_features, dim, g, self.orthogonal)
        return self._proj[dim]

    def features(self, x: Tensor, p: Problem, is_query: bool) -> Tensor:
        w = self.projection(p.D).to(device=x.device, dtype=x.dtype)  # (F, D)
        x = x * math.sqrt(p.scale)
        wx = x @ w.T  # (B, H, N, F)
        sq = (x * x).sum(-1, keepdim=True) / 2  # (B, H, N, 1)
        # the stabiliser: per query row (cancels in that row's num / den), per (batch, head) for keys
        c = wx.amax(dim=-1, keepdim=True) if is_query else wx.amax(dim=(-2, -1), keepdim=True)
        return torch.exp(wx - sq - c.detach()) / math.sqrt(self.n_features)

    def arguments(self) -> list[str]:
        extra = [] if self.orthogonal else ["orthogonal=False"]
        return [str(self.n_features), *extra, *([f"seed={self.seed}"] if self.seed else [])]

    def extra_repr(self) -> str:
        return f"features={self.n_features}, orthogonal={self.orthogonal}, seed={self.seed}"
