"""Rotary position embeddings applied to q and k (Su et al., 2021, RoFormer; LLaMA, Mistral, Qwen2): each
pair of q/k features rotates by ``pos * theta_i`` with ``theta_i = base^(-2i/D)``, so that ``q_m . k_n``
depends on the positions only through ``m - n``.

- :class:`RotaryEmbedding` rotates every pair, half-split (Hugging Face) or interleaved (Meta) layout.
- :class:`PartialRotary` rotates only some of those pairs, a chosen subset per group of heads, at their
  original frequencies (the partial RoPE of MHA2MLA, Ji et al., 2025).

Both are re-exported by :mod:`multihead.nn.positions`.

Shape legend: B batch, H heads, N positions, D head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .position_checks import check_positions, check_size

__all__ = ["PartialRotary", "RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding: rotate feature pairs of q or k by ``pos * theta_i``.

    Args:
        head_dim: D, the per-head feature count; must be even.
        base: the frequency base, ``theta_i = base^(-2i/D)`` for ``i < D/2`` (LLaMA 10000, LLaMA 3 500000).
        interleaved: which features form a pair.

            - False: half-split, pairs ``(i, i + D/2)`` - Hugging Face ``rotate_half``, GPT-NeoX.
            - True: interleaved, pairs ``(2i, 2i + 1)`` as one complex number - Meta's original LLaMA.

            The two differ only by a permutation of the q/k projection rows; convert checkpoints with
            :meth:`permute_for_interleaved` / :meth:`permute_for_half_split`.

    cos/sin are computed in float32 (float64 for float64 input) exactly as Hugging Face computes them, so
    no cast of the module to bf16 can degrade them. :meth:`forward` recomputes them from the positions on
    each call; :meth:`rotate_pair` (what ``MultiHeadAttention`` uses) rotates q and k with one cos/sin,
    and for consecutive positions ``start .. start+N-1`` slices a cached table (values identical to
    recomputing; not part of the state dict) so a decode step does no trigonometry per layer.

    Raises:
        ValueError: if ``head_dim`` is not a positive even int, or ``base`` is not a finite number > 0.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, interleaved: bool = False):
        super().__init__()
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 2 or head_dim % 2:
            raise ValueError(
                f"RotaryEmbedding head_dim must be a positive even int (features rotate in pairs), "
                f"got {head_dim!r}"
            )
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0 or base == math.inf:
            raise ValueError(f"RotaryEmbedding base must be a finite number > 0, got {base!r}")
        self.head_dim = head_dim
        self.base = float(base)
        self.interleaved = bool(interleaved)

    def inv_freq(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> Tensor:
        """theta_i = base^(-2i/D), shape (D/2,), computed as ``1 / base ** (2i / D)`` like HF and Meta."""
        two_i = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).to(dtype)  # (D/2,)
        return 1.0 / (self.base ** (two_i / self.head_dim))  # (D/2,)

    def cos_sin(
        self, positions: Tensor, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """cos and sin of ``pos * theta_i``: positions (N,) -> (N, D/2); (B, N) -> (B, 1, N, D/2)."""
        positions = check_positions(positions, "RotaryEmbedding")
        angle = positions.to(device=device, dtype=dtype).unsqueeze(-1) * self.inv_freq(dtype, device)
        if angle.dim() == 3:
            angle = angle.unsqueeze(1)  # (B, 1, N, D/2): broadcasts over heads
        return angle.cos(), angle.sin()

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate x (B, H, N, D) at positions (N,) or (B, N); returns (B, H, N, D) in x's dtype.

        Positions may be any integers (negative too); a decode step passes ``arange(p, p + N)`` with
        ``p = cache.position``.

        Raises:
            ValueError: if x is not a 4-dim float tensor with last dim ``head_dim``, or positions are not
                integers of shape (N,) or (B, N) (B = x's batch size or 1) matching x's N.
        """
        self._check_x(x, positions)
        f = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = self.cos_sin(positions, f, x.device)  # (N, D/2) or (B, 1, N, D/2)
        return self._rotate(x, cos, sin)

    def rotate_pair(
        self, q: Tensor, k: Tensor, positions: Tensor | None = None, start: int = 0
    ) -> tuple[Tensor, Tensor]:
        """Rotate q (B, Hq, N, D) and k (B, Hkv, N, D) at the same positions with one cos/sin.

        ``positions`` (N,) or (B, N) as in :meth:`forward`; when None the positions are
        ``start .. start + N - 1``, read from a cached table.

        Raises:
            ValueError: as :meth:`forward`, or ``start`` not an int >= 0.
        """
        if positions is not None:
            self._check_x(q, positions)
            self._check_x(k, positions)
            f = torch.float64 if q.dtype == torch.float64 else torch.float32
            cos, sin = self.cos_sin(positions, f, q.device)  # (N, D/2) or (B, 1, N, D/2)
        else:
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise ValueError(f"RotaryEmbedding start must be an int >= 0, got {start!r}")
            for t in (q, k):
                if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[-1] != self.head_dim:
                    raise ValueError(
                        f"rotate_pair expects (B, H, N, {self.head_dim}) tensors, got "
                        f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}"
                    )
            cos, sin = self._table(start, q.shape[2], q.dtype, q.device)  # 2 x (N, D/2)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _table(self, start: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos/sin rows ``start : start + n`` of the cached table, grown (doubling) when too short."""
        f = torch.float64 if dtype == torch.float64 else torch.float32
        key = (f, device, self.base, self.head_dim)
        tables: dict = self.__dict__.setdefault("_tables", {})
        cos, sin = tables.get(key, (None, None))
        if cos is None or cos.shape[0] < start + n:
            size = max(256, 2 * (start + n))
            cos, sin = self.cos_sin(torch.arange(size, device=device), f, device)  # 2 x (size, D/2)
            tables[key] = (cos, sin)
        return cos[start : start + n], sin[start : start + n]  # 2 x (n, D/2)

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        f = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(f)
        half = self.head_dim // 2
        if self.interleaved:
            x1, x2 = xf.unflatten(-1, (half, 2)).unbind(-1)  # 2 x (B, H, N, D/2): real, imaginary parts
        else:
            x1, x2 = xf[..., :half], xf[..., half:]  # 2 x (B, H, N, D/2): first, second half
        o1 = x1 * cos - x2 * sin  # (B, H, N, D/2)
        o2 = x2 * cos + x1 * sin  # (B, H, N, D/2)
        pairs = (o1, o2)
        out = torch.stack(pairs, -1).flatten(-2) if self.interleaved else torch.cat(pairs, -1)  # (B, H, N, D)
        return out.to(x.dtype)

    def _check_x(self, x: Tensor, positions: Tensor) -> None:
        if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"RotaryEmbedding expects a float tensor (B, H, N, D), got {got}; "
                "split heads first with x.view(B, N, H, D).transpose(1, 2)"
            )
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"RotaryEmbedding was built for head_dim={self.head_dim} but x has D={x.shape[-1]} "
                f"(x shape {tuple(x.shape)})"
            )
        positions = check_positions(positions, "RotaryEmbedding")
        B, N = x.shape[0], x.shape[2]
        if positions.shape[-1] != N or (positions.dim() == 2 and positions.shape[0] not in (1, B)):
            raise ValueError(
                f"RotaryEmbedding positions of shape {tuple(positions.shape)} do not fit x of shape "
                f"{tuple(x.shape)}; pass (N,) = ({N},) or (B, N) = ({B}, {N})"
            )

    # -- checkpoint conversion between the two pairings --------------------------------------------------
    @staticmethod
    def permute_for_interleaved(w: Tensor, n_heads: int) -> Tensor:
        """Reorder q/k projection rows so that ``interleaved=True`` on the result equals half-split on ``w``.

        Within each head, half-split row ``j * D/2 + i`` becomes row ``2i + j`` (j in {0, 1}). ``w`` is a
        weight (H*D, d_in) or bias (H*D,) with H = ``n_heads`` (the kv heads for the k projection).
        The rotated outputs then agree up to the same per-head feature permutation, so every score
        ``q . k`` is unchanged.

        Raises:
            ValueError: if ``w.shape[0]`` is not ``n_heads`` times an even head dim.
        """
        H, D = n_heads, _head_dim_of(w, n_heads)
        wh = w.reshape(H, 2, D // 2, *w.shape[1:])  # (H, 2, D/2, ...): [head, half, pair index]
        return wh.transpose(1, 2).reshape(w.shape)  # (H*D, ...): rows 2i + j

    @staticmethod
    def permute_for_half_split(w: Tensor, n_heads: int) -> Tensor:
        """The inverse of :meth:`permute_for_interleaved`: a Meta (interleaved) checkpoint -> HF layout.

        This is ``permute`` of transformers' ``convert_llama_weights_to_hf.py``.

        Raises:
            ValueError: if ``w.shape[0]`` is not ``n_heads`` times an even head dim.
        """
        H, D = n_heads, _head_dim_of(w, n_heads)
        wi = w.reshape(H, D // 2, 2, *w.shape[1:])  # (H, D/2, 2, ...): [head, pair index, half]
        return wi.transpose(1, 2).reshape(w.shape)  # (H*D, ...): rows j * D/2 + i

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base}, interleaved={self.interleaved}"


class PartialRotary(nn.Module):
    """Rotary on a subset of the frequency pairs of ``RotaryEmbedding(full_dim, base)``, one subset per
    group of heads: the partial RoPE of MHA2MLA (Ji et al., 2025, "Towards Economical Inference: Enabling
    DeepSeek's Multi-Head Latent Attention in Any Transformer-based LLMs"), which keeps a few rotary pairs
    of each head and drops the rotation of the others.

    Args:
        pairs: (G, P) integer tensor: for each of G head groups, the frequency indices i it keeps
            (0 <= i < full_dim / 2), in the order of its features. Pair m of group g rotates by
            ``pos * theta_{pairs[g, m]}`` with ``theta_i = base^(-2i/full_dim)`` - the frequencies the
            full rotary gives those pairs, computed by the same formula, so that keeping every pair in
            order reproduces ``RotaryEmbedding(full_dim, base)`` bit for bit.
        full_dim: the head dim of the rotary whose frequencies are kept.
        base: its frequency base.

    Features of x (B, H, N, R), R = 2P = ``head_dim``, are in the half-split layout: features m and m + P
    form pair m. H must be a multiple of G; head h belongs to group ``h // (H / G)`` (H = G for one key per
    group, H = the query heads for the queries: the GQA grouping). ``pairs`` is a buffer, saved in the
    state dict (a data-dependent choice); integer, so ``.to(dtype)`` leaves it exact.

    Raises:
        ValueError: pairs that are not a non-empty (G, P) integer tensor of indices in [0, full_dim / 2),
            a full_dim that is not a positive even int, a base that is not a finite number > 0.
    """

    pairs: Tensor

    def __init__(self, pairs: Tensor, full_dim: int, base: float = 10000.0):
        super().__init__()
        self.full = RotaryEmbedding(full_dim, base)  # validates full_dim and base; the frequency source
        ok = isinstance(pairs, Tensor) and pairs.dim() == 2 and pairs.numel() > 0
        if not ok or pairs.is_floating_point() or pairs.is_complex() or pairs.dtype == torch.bool:
            got = f"{pairs.dtype} {tuple(pairs.shape)}" if isinstance(pairs, Tensor) else type(pairs).__name__
            raise ValueError(f"PartialRotary pairs must be a non-empty (G, P) integer tensor, got {got}")
        half = full_dim // 2
        if int(pairs.min()) < 0 or int(pairs.max()) >= half:
            raise ValueError(
                f"PartialRotary pairs must index the {half} frequency pairs of full_dim={full_dim}: "
                f"values in [0, {half}), got min {int(pairs.min())} and max {int(pairs.max())}"
            )
        self.register_buffer("pairs", pairs.detach().long().clone())
        self.groups, self.head_dim = int(pairs.shape[0]), 2 * int(pairs.shape[1])

    @property
    def base(self) -> float:
        return self.full.base

    def cos_sin(self, positions: Tensor, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos and sin of every group's kept angles: positions (N,) -> (G, 1, N, P), broadcasting over
        x viewed as (B, G, H / G, N, P); (B, N) -> (B, G, 1, N, P)."""
        cos, sin = self.full.cos_sin(positions, dtype, device)  # (N, D/2) or (B, 1, N, D/2)
        idx = self.pairs.to(device)  # (G, P)
        out = []
        for t in (cos, sin):
            t = t[..., idx]  # (N, G, P) or (B, 1, N, G, P)
            if t.dim() == 3:
                out.append(t.permute(1, 0, 2).unsqueeze(1))  # (G, 1, N, P)
            else:
                out.append(t.squeeze(1).permute(0, 2, 1, 3).unsqueeze(2))  # (B, G, 1, N, P)
        return out[0], out[1]

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate x (B, H, N, R) at positions (N,) or (B, N); returns (B, H, N, R) in x's dtype.

        Raises:
            ValueError: x not a 4-dim float tensor with last dim ``head_dim`` and a head count that is a
                multiple of the groups, positions that are not integers (N,) or (B, N) matching x.
        """
        if (
            not isinstance(x, Tensor)
            or x.dim() != 4
            or not x.is_floating_point()
            or x.shape[-1] != self.head_dim
        ):
            got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"PartialRotary expects a float tensor (B, H, N, {self.head_dim}), got {got}")
        B, H, N, R = x.shape
        if H % self.groups:
            raise ValueError(
                f"PartialRotary has {self.groups} head groups; x has {H} heads, not a multiple of them"
            )
        positions = check_positions(positions, "PartialRotary")
        if positions.shape[-1] != N or (positions.dim() == 2 and positions.shape[0] not in (1, B)):
            raise ValueError(
                f"PartialRotary positions of shape {tuple(positions.shape)} do not fit x of shape "
                f"{tuple(x.shape)}; pass (N,) = ({N},) or (B, N) = ({B}, {N})"
            )
        f = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = self.cos_sin(positions, f, x.device)  # (G, 1, N, P) or (B, G, 1, N, P)
        xg = x.to(f).reshape(B, self.groups, H // self.groups, N, R)  # (B, G, H/G, N, R)
        x1, x2 = xg[..., : R // 2], xg[..., R // 2 :]  # 2 x (B, G, H/G, N, P)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)  # (B, G, H/G, N, R)
        return out.reshape(B, H, N, R).to(x.dtype)  # (B, H, N, R)

    def extra_repr(self) -> str:
        return (
            f"groups={self.groups}, head_dim={self.head_dim}, full_dim={self.full.head_dim}, base={self.base}"
        )


def _head_dim_of(w: Tensor, n_heads: int) -> int:
    check_size("n_heads", n_heads)
    if w.dim() < 1 or w.shape[0] % n_heads or (w.shape[0] // n_heads) % 2:
        raise ValueError(
            f"a q/k projection of shape {tuple(w.shape)} does not split into n_heads={n_heads} heads of an "
            "even head dim; pass the kv head count for the k projection"
        )
    return w.shape[0] // n_heads
