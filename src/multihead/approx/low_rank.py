"""Low-rank attention: ``A ~ U V^T`` with rank r << N.

    Linformer(k, max_len):  K' = E K, V' = F V with E, F (k x N) projections along the sequence;
                            out = softmax(Q K'^T * scale) V'                  O(N k) time and memory
    Nystrom(landmarks):     m segment-mean landmarks Q~, K~ of the queries and keys;
                            out = softmax(Q K~^T) pinv(softmax(Q~ K~^T)) (softmax(Q~ K^T) V)   O(N m)
    LowRank(rank):          the exact A (N x N) replaced by its best rank-r approximation (truncated SVD,
                            or a randomized range finder): an analysis tool for "how low-rank is A?"

Linformer and Nystrom mix every position of the sequence, so they have no causal form; key padding is
honoured (padded keys are zeroed before the projection; landmarks are means over real positions only).
LowRank forms A exactly and accepts any mask and bias.

Shape legend: B batch, Hq query heads, Hkv kv heads, G = Hq // Hkv, Nq queries, Nk keys, D head dim,
Dv value head dim, m landmarks, r rank.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from ..backends import registry
from ..backends.dense import safe_softmax
from ..core.checks import check_int
from ..core.functional import attention
from ..core.problem import Problem
from .base import Approximation

__all__ = ["Linformer", "LowRank", "Nystrom"]


class Linformer(Approximation):
    """Linformer (Wang et al. 2020): project keys and values along the sequence to ``k`` rows.

    ``E`` and ``F`` are (k, max_len) matrices, N(0, 1/k) at initialisation (a Johnson-Lindenstrauss
    projection); a sequence of Nk <= max_len positions uses their first Nk columns. With ``learned=True``
    they are parameters (train them with the model; :func:`~multihead.approx.apply` gives each layer its
    own copy), else fixed buffers drawn from ``seed``. With ``k = Nk`` and E = F = identity the result is
    exact attention.

    Args:
        k: projected length, an int >= 1.
        max_len: the longest sequence (Nk) accepted.
        learned: projections as trainable parameters.
        seed: seed of the initial projections.

    Raises:
        ValueError: ``k`` or ``max_len`` not an int >= 1; at call time, Nk > max_len.
    """

    supports_causal = False
    summary = "keys and values projected along the sequence to k rows (O(N k) time and memory)"

    def __init__(self, k: int, max_len: int, *, learned: bool = False, seed: int = 0):
        super().__init__()
        self.k = check_int("k", k, 1, owner="Linformer")
        self.max_len = check_int("max_len", max_len, 1, owner="Linformer")
        self.learned, self.seed = bool(learned), seed
        g = torch.Generator().manual_seed(seed)
        e, f = (torch.randn(k, max_len, generator=g) / k**0.5 for _ in range(2))  # (k, max_len) each
        if self.learned:
            self.proj_k, self.proj_v = nn.Parameter(e), nn.Parameter(f)
        else:
            self.register_buffer("proj_k", e)
            self.register_buffer("proj_v", f)

    def arguments(self) -> list[str]:
        extra = (["learned=True"] if self.learned else []) + ([f"seed={self.seed}"] if self.seed else [])
        return [str(self.k), str(self.max_len), *extra]

    def why_not(self, p: Problem) -> str | None:
        reason = super().why_not(p)
        if reason is None and p.Nk > self.max_len:
            reason = f"Linformer(max_len={self.max_len}) got Nk={p.Nk} keys; build it with max_len >= {p.Nk}"
        return reason

    def attend(self, p: Problem) -> Tensor:
        keys = self.split(p).keys  # (B|1, 1, 1, Nk) or None
        k, v = p.k, p.v
        if keys is not None:
            real = keys.to(k.dtype).transpose(-1, -2)  # (B|1, 1, Nk, 1)
            k, v = k * real, v * real  # padded keys and values contribute nothing to the projections
        e = self.proj_k[:, : p.Nk].to(k.dtype)  # (k, Nk)
        f = self.proj_v[:, : p.Nk].to(v.dtype)  # (k, Nk)
        out = attention(p.q, torch.matmul(e, k), torch.matmul(f, v), scale=p.scale)  # (B, Hq, Nq, Dv)
        assert isinstance(out, Tensor)
        if keys is not None:  # a batch row without any real key attends to nothing: zeros
            out = out * keys.any(dim=-1, keepdim=True).to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"k={self.k}, max_len={self.max_len}, learned={self.learned}"


def _landmarks(x: Tensor, real: Tensor | None, m: int) -> tuple[Tensor, Tensor]:
    """Segment means of x (B, H, N, D) over m nearly equal segments of the real positions.

    Real position j with rank r_j among the L real positions of its row falls in segment floor(r_j m / L),
    so segments are contiguous, of sizes floor or ceil of L/m, for any L (not only multiples of m). With
    L < m each real position is a segment of its own and m - L segments are empty.

    Returns:
        landmarks (B, H, m, D) (zeros for empty segments) and present (B|1, 1, m) bool.
    """
    B, H, N, D = x.shape
    if real is None:
        real = torch.ones(1, N, dtype=torch.bool, device=x.device)  # (1, N)
    rank = real.long().cumsum(-1) - 1  # (B|1, N)
    length = real.sum(-1, keepdim=True).clamp(min=1)  # (B|1, 1)
    seg = torch.where(real, rank * m // length, torch.full_like(rank, m))  # (B|1, N): m = a discard bin
    seg = seg.view(seg.shape[0], 1, N, 1)  # (B|1, 1, N, 1)
    sums = x.new_zeros(B, H, m + 1, D).scatter_add(2, seg.expand(B, H, N, D), x)[:, :, :m]  # (B, H, m, D)
    ones = real.to(x.dtype).view(seg.shape)  # (B|1, 1, N, 1)
    counts = ones.new_zeros(seg.shape[0], 1, m + 1, 1).scatter_add(2, seg, ones)[:, :, :m]  # (B|1, 1, m, 1)
    present = counts[..., 0] > 0  # (B|1, 1, m)
    return sums / counts.clamp(min=1), present


def _iterative_pinv(a: Tensor, iterations: int) -> Tensor:
    """Moore-Penrose pseudo-inverse of a (..., m, m) by the iteration of Razavi et al. (2014), as in
    Nystromformer: Z0 = a^T / (max col sum * max row sum), Z <- Z (13 I - aZ (15 I - aZ (7 I - aZ))) / 4."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    norm = a.abs().sum(-2).amax(-1) * a.abs().sum(-1).amax(-1)  # (...,)
    z = a.transpose(-1, -2) / norm.clamp(min=torch.finfo(a.dtype).tiny)[..., None, None]
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def _exact_product(f1: Tensor, a2: Tensor, b3: Tensor, v: Tensor) -> Tensor:
    """``f1 pinv(a2) b3 v`` with the pseudo-inverse from an SVD and every product in float64.

    With every key its own landmark, K~ = K, so a2 and b3 are softmax(Q~ K^T s) and f1 is softmax(Q K^T s):
    pinv(a2) a2 projects onto the row space of a2, which holds the rows of f1, and the product is exact
    attention f1 v. The projection is only as exact as the pseudo-inverse: a few Newton-Schulz iterations
    leave errors of order 1e-2, and a float32 pseudo-inverse multiplies rounding by the condition number
    of a2, hence float64 throughout.

    Args:
        f1: (B, Hkv, G, Nq, m); a2: (B, Hkv, G, m, m); b3: (B, Hkv, G, m, Nk); v: (B, Hkv, 1, Nk, Dv).

    Returns:
        (B, Hkv, G, Nq, Dv) in the dtype of v.
    """
    f64 = torch.float64
    inv = torch.linalg.pinv(a2.to(f64))  # (B, Hkv, G, m, m)
    out = f1.to(f64) @ (inv @ (b3.to(f64) @ v.to(f64)))  # (B, Hkv, G, Nq, Dv)
    return out.to(v.dtype)


class Nystrom(Approximation):
    """Nystromformer (Xiong et al. 2021): attention through m segment-mean landmarks.

    ``out = softmax(Q K~^T s) pinv(softmax(Q~ K~^T s)) (softmax(Q~ K^T s) V)`` with Q~, K~ the means of m
    nearly equal contiguous segments of the (real) queries and keys; any length works, not only multiples
    of m. With m >= Nk every key is its own landmark and the result is exact attention: that case always
    takes the exact pseudo-inverse (an SVD) and float64 products, whatever ``pinv_iterations`` says, at
    O(m^3) cost. Query landmarks use the key padding too when Nq == Nk (self-attention over a padded batch).

    Args:
        landmarks: m, an int >= 1.
        pinv_iterations: iterations of the iterative pseudo-inverse (6 in the paper), or None for
            ``torch.linalg.pinv``; used when m < Nk.

    Raises:
        ValueError: ``landmarks`` not an int >= 1, ``pinv_iterations`` not None or an int >= 1.
    """

    supports_causal = False
    summary = "attention through m segment-mean landmarks and a pseudo-inverse (O(N m) time and memory)"

    def __init__(self, landmarks: int, *, pinv_iterations: int | None = 6):
        super().__init__()
        self.landmarks = check_int("landmarks", landmarks, 1, owner="Nystrom")
        if pinv_iterations is not None:
            check_int("pinv_iterations", pinv_iterations, 1, owner="Nystrom")
        self.pinv_iterations = pinv_iterations

    def arguments(self) -> list[str]:
        extra = [] if self.pinv_iterations == 6 else [f"pinv_iterations={self.pinv_iterations}"]
        return [str(self.landmarks), *extra]

    def attend(self, p: Problem) -> Tensor:
        keys = self.split(p).keys
        real_k = None if keys is None else keys[:, 0, 0]  # (B|1, Nk)
        real_q = real_k if p.Nq == p.Nk else None
        m, s = self.landmarks, p.scale
        q5 = p.q.view(p.B, p.Hkv, p.G, p.Nq, p.D)  # (B, Hkv, G, Nq, D)
        ql, q_present = _landmarks(p.q, real_q, m)  # (B, Hq, m, D), (B|1, 1, m)
        kl, k_present = _landmarks(p.k, real_k, m)  # (B, Hkv, m, D), (B|1, 1, m)
        ql5 = ql.view(p.B, p.Hkv, p.G, m, p.D)  # (B, Hkv, G, m, D)
        kl5, k5, v5 = kl[:, :, None], p.k[:, :, None], p.v[:, :, None]  # (B, Hkv, 1, ., .)
        no_kl = ~k_present[:, :, None, None]  # (B|1, 1, 1, 1, m): absent key landmarks get no weight
        neg_inf = float("-inf")
        f1, _ = safe_softmax((q5 @ kl5.transpose(-1, -2) * s).masked_fill(no_kl, neg_inf))  # (.., Nq, m)
        a2, _ = safe_softmax((ql5 @ kl5.transpose(-1, -2) * s).masked_fill(no_kl, neg_inf))  # (.., m, m)
        s3 = ql5 @ k5.transpose(-1, -2) * s  # (B, Hkv, G, m, Nk)
        if real_k is not None:
            s3 = s3.masked_fill(~real_k[:, None, None, None, :], neg_inf)
        b3, _ = safe_softmax(s3)
        q_absent = ~q_present[:, :, None, :, None]  # (B|1, 1, 1, m, 1): absent query landmarks: zero rows
        a2, b3 = a2.masked_fill(q_absent, 0.0), b3.masked_fill(q_absent, 0.0)
        if m >= p.Nk:  # every key is a landmark: exact attention, through the exact pseudo-inverse
            out = _exact_product(f1, a2, b3, v5)  # (B, Hkv, G, Nq, Dv)
        else:
            if self.pinv_iterations is None:
                inv = torch.linalg.pinv(a2)  # (B, Hkv, G, m, m)
            else:
                inv = _iterative_pinv(a2, self.pinv_iterations)
            out = f1 @ (inv @ (b3 @ v5))  # (B, Hkv, G, Nq, Dv)
        if real_k is not None:  # a batch row without any real key attends to nothing: zeros
            out = out * real_k.any(-1).to(out.dtype)[:, None, None, None, None]
        return out.reshape(p.B, p.Hq, p.Nq, p.Dv)  # (B, Hq, Nq, Dv)

    def extra_repr(self) -> str:
        return f"landmarks={self.landmarks}, pinv_iterations={self.pinv_iterations}"


class LowRank(Approximation):
    """Exact attention weights A replaced by a rank-r approximation ``U V^T``.

    ``method="svd"``: the truncated SVD, the best rank-r approximation (Eckart-Young); ``"random"``: a
    randomized range finder (Halko et al. 2011: r + 8 Gaussian probes, 2 power iterations, seeded).
    A is formed exactly (O(N^2) memory; any mask and bias apply), so this is a tool to measure how much
    of attention a rank-r matrix keeps, not a speed-up.

    Args:
        rank: r, an int >= 1 and <= min(Nq, Nk) at call time.
        method: "svd" or "random".
        seed: seed of the random probes.
        clamp: use ``min(rank, Nq, Nk)`` on shorter inputs (exact there) instead of raising: for a
            model that sees sequences of many lengths.

    Raises:
        ValueError: ``rank`` < 1, an unknown method; at call time, ``rank > min(Nq, Nk)`` unless clamp.
    """

    supports_causal = True
    supports_any_mask = True
    summary = "the exact weights replaced by their rank-r approximation (an analysis tool, O(N^2))"

    def __init__(self, rank: int, method: str = "svd", *, seed: int = 0, clamp: bool = False):
        super().__init__()
        self.rank = check_int("rank", rank, 1, owner="LowRank")
        if method not in ("svd", "random"):
            raise ValueError(f"LowRank method must be 'svd' or 'random', got {method!r}")
        self.method, self.seed, self.clamp = method, seed, bool(clamp)

    def arguments(self) -> list[str]:
        extra = [] if self.method == "svd" else [repr(self.method)]
        extra += ([f"seed={self.seed}"] if self.seed else []) + (["clamp=True"] if self.clamp else [])
        return [str(self.rank), *extra]

    def why_not(self, p: Problem) -> str | None:
        reason = super().why_not(p)
        n = min(p.Nq, p.Nk)
        if reason is None and self.rank > n and not self.clamp:
            reason = (
                f"LowRank rank={self.rank} exceeds min(Nq, Nk)={n}: a {p.Nq} x {p.Nk} matrix has rank "
                f"<= {n}; use rank <= {n}"
            )
        return reason

    def attend(self, p: Problem) -> Tensor:
        n = min(p.Nq, p.Nk)
        # the exact weights of the already validated problem, from the backend that forms them
        res = registry.get("matrix").run(replace(p, return_weights=True, return_lse=False))
        assert res.weights is not None
        a = res.weights.view(p.B, p.Hkv, p.G, p.Nq, p.Nk)  # (B, Hkv, G, Nq, Nk)
        u, v = self._factors(a, min(self.rank, n))  # (.., Nq, r), (.., r, Nk)
        out = u @ (v @ p.v[:, :, None])  # (B, Hkv, G, Nq, Dv)
        return out.reshape(p.B, p.Hq, p.Nq, p.Dv)  # (B, Hq, Nq, Dv)

    def _factors(self, a: Tensor, r: int) -> tuple[Tensor, Tensor]:
        if self.method == "svd":
            u, sv, vh = torch.linalg.svd(a, full_matrices=False)
            return u[..., :r] * sv[..., None, :r], vh[..., :r, :]
        g = torch.Generator(device=a.device).manual_seed(self.seed)
        probes = min(r + 8, a.shape[-1])
        omega = torch.randn(a.shape[-1], probes, generator=g, device=a.device, dtype=a.dtype)  # (Nk, r+p)
        y = a @ omega  # (.., Nq, r+p)
        for _ in range(2):  # power iterations sharpen the range for slowly decaying spectra
            y = a @ (a.transpose(-1, -2) @ torch.linalg.qr(y).Q)
        basis = torch.linalg.qr(y).Q  # (.., Nq, r+p)
        ub, sv, vh = torch.linalg.svd(basis.transpose(-1, -2) @ a, full_matrices=False)  # of (r+p) x Nk
        return (basis @ ub[..., :r]) * sv[..., None, :r], vh[..., :r, :]

    def extra_repr(self) -> str:
        return f"rank={self.rank}, method={self.method!r}"
