"""``sdpa``: torch's fused ``scaled_dot_product_attention``, used only where its semantics equal ours.

* ``is_causal=True`` only when Nq == Nk: torch's causal flag is top-left aligned, ours bottom-right, so
  any other causal mask is passed as an explicit boolean ``attn_mask``.
* A boolean ``attn_mask`` has our convention (True = may attend); additive biases are folded into a float
  ``attn_mask`` (-inf where masked). Soft-capping has no SDPA form.
* GQA through ``enable_gqa=True`` (query head i reads kv head i // G, like ours) - no repeated K/V.
* Rows with no allowed key: torch >= 2.5 returns zeros there; we additionally zero them explicitly so the
  convention does not hang on a torch version.
* Half-precision training is refused on the CPU only (torch's CPU backward in bf16/fp16 is less exact
  than the rule allows); on CUDA its flash kernel's backward serves it.
* A mask or bias is materialised as a dense (.., Nq, Nk) ``attn_mask``: calls whose mask and bias would
  take more than ``MULTIHEAD_MAX_SCORE_BYTES`` (or the free memory) are refused before anything is
  allocated, as on every dense path (``auto`` leaves large masks to ``tiled`` long before).
* Attention sinks: SDPA has no sink term and does not return the log-sum-exp that would let us add one
  afterwards, so calls with ``sinks`` are refused (``auto`` then takes ``decode`` or ``tiled``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.mask_keys import mask_dims
from ..core.problem import AttentionOutput, Problem
from ..core.tiles import nonempty_fraction
from .dense import check_dense_size, dense_size_problem

# Refuse under `auto` when a materialised mask/bias would exceed this many bytes.
MAX_MASK_BYTES = 256 << 20
# Leave a bias larger than this to `tiled`, which builds it one tile at a time instead of in full.
MAX_BIAS_BYTES = 16 << 20
# Leave a mask to `tiled` when it empties more than this fraction of the 64 x 64 tiles.
MAX_EMPTY_FRACTION = 0.2
# On CPU, torch's SDPA serves a value width Dv != D with its math path (the (Nq, Nk) scores in full):
# leave such calls to `tiled` from this many scores per head on (measured fp32, D=32, Dv=64, 1 thread:
# SDPA 2x slower at 256 x 256, 4.5x at 1024 x 1024; faster below 64 x 64).
MAX_UNEQUAL_DV_SCORES = 128 * 128


class SdpaBackend:
    name = "sdpa"
    summary = "torch.nn.functional.scaled_dot_product_attention (fused, no O(N^2) memory when unmasked)"

    def why_not(self, p: Problem) -> str | None:
        if p.return_weights:
            return "SDPA cannot return the attention weights"
        if p.return_lse:
            return "SDPA does not expose the log-sum-exp"
        if p.sinks is not None:
            return "SDPA has no sink term (and no public log-sum-exp to add one exactly afterwards)"
        if p.bias is not None and not p.bias.is_additive:
            return f"{p.bias!r} is not an additive bias, SDPA has no hook for it"
        if p.dtype in (torch.float16, torch.bfloat16) and p.needs_grad and p.q.device.type == "cpu":
            return (
                f"SDPA's CPU backward in {p.dtype} measured up to 3.9x the matrix path's gradient error "
                "(the bound is 3x); the tiled backward accumulates in fp32"
            )
        if p.bias is not None and p.dtype in (torch.float16, torch.bfloat16):
            return f"SDPA would round the bias to {p.dtype} in its float attn_mask"
        if (p.mask is not None and not (p.mask.is_causal and p.Nq == p.Nk)) or p.bias is not None:
            n = p.B * p.Hq * p.Nq * p.Nk  # upper bound of the materialised mask
            if n * (4 if p.bias is not None else 1) > MAX_MASK_BYTES:
                return f"the mask/bias would be materialised as a dense {n * 4 / 2**20:.0f} MiB tensor"
            over = dense_size_problem(p, attn_mask_bytes(p))
            if over is not None:
                return f"the mask/bias as a dense attn_mask would take {over}"
        return self._why_slower(p)

    def _why_slower(self, p: Problem) -> str | None:
        """Calls SDPA could serve, but `tiled` serves faster (it skips what SDPA would compute)."""
        if p.Dv != p.D and p.q.device.type == "cpu" and p.Nq * p.Nk >= MAX_UNEQUAL_DV_SCORES:
            return (
                f"on CPU, torch's SDPA computes Dv={p.Dv} != D={p.D} with its math path, all "
                f"{p.Nq}x{p.Nk} scores at once; tiled keeps its fused tiles"
            )
        if p.bias is not None and p.B * p.Hq * p.Nq * p.Nk * 4 > MAX_BIAS_BYTES:
            mib = p.B * p.Hq * p.Nq * p.Nk * 4 / 2**20
            return f"SDPA needs the bias as a dense {mib:.0f} MiB tensor; tiled builds it a tile at a time"
        if p.mask is not None and not (p.mask.is_causal and p.Nq == p.Nk):
            grid = p.analytic_grid(64, 64)
            frac = None if grid is None else nonempty_fraction(grid)
            if frac is not None and 1.0 - frac > MAX_EMPTY_FRACTION:
                return (
                    f"the mask empties {100 * (1 - frac):.0f}% of the 64x64 tiles; SDPA would compute "
                    "them all, tiled skips them"
                )
        return None

    def run(self, p: Problem) -> AttentionOutput:
        if p.return_weights or p.return_lse:
            raise ValueError("backend 'sdpa' cannot return weights or lse; use 'matrix' or 'tiled'")
        if p.bias is not None and not p.bias.is_additive:
            raise ValueError(f"backend 'sdpa' cannot apply {p.bias!r}; use 'tiled' or 'matrix'")
        if p.sinks is not None:
            raise ValueError(
                "backend 'sdpa' cannot apply sinks: torch SDPA has no sink term and hides its log-sum-exp; "
                "use backend='auto' (it picks 'tiled' or 'decode'), 'tiled' or 'matrix'"
            )
        ctx = p.ctx
        attn_mask = None
        is_causal = False
        allowed = None
        if p.mask is not None and p.mask.is_causal and p.Nq == p.Nk and p.bias is None:
            is_causal = True
        elif p.mask is not None or p.bias is not None:
            parts = " and ".join(n for n, x in (("mask", p.mask), ("bias", p.bias)) if x is not None)
            what = f"the {parts} as a dense attn_mask over (Nq, Nk) = ({p.Nq}, {p.Nk})"
            check_dense_size(p, self.name, attn_mask_bytes(p), what)
            if p.mask is not None:
                allowed = p.mask.natural(ctx, p.q.device)  # (B|1, Hq|1, Nq, Nk)
            if p.bias is not None:
                attn_mask = p.bias.natural(ctx, p.q.device, p.dtype)  # (B|1, Hq|1, Nq, Nk)
                if allowed is not None:
                    attn_mask = attn_mask.masked_fill(~allowed, float("-inf"))
            else:
                attn_mask = allowed
        out = F.scaled_dot_product_attention(
            p.q,
            p.k,
            p.v,
            attn_mask=attn_mask,
            dropout_p=p.dropout_p,
            is_causal=is_causal,
            scale=p.scale,
            enable_gqa=p.Hq != p.Hkv,
        )
        if allowed is not None:
            has_key = allowed.any(dim=-1, keepdim=True)  # (B|1, Hq|1, Nq, 1)
            if not bool(has_key.all()):
                out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return AttentionOutput(out, None, None)


def attn_mask_bytes(p: Problem) -> int:
    """Bytes of the dense attn_mask :meth:`SdpaBackend.run` builds for ``p`` (a mask or a bias set): the
    bool mask at its natural shape, and the float copy torch makes of it in q's dtype; or the bias in q's
    dtype (counted at (B, Hq, Nq, Nk)) and its masked copy."""
    elt = p.q.element_size()
    plane = p.Nq * p.Nk
    nm = 0
    if p.mask is not None:
        by_batch, by_head = mask_dims(p.mask, p.ctx)
        nm = (p.B if by_batch else 1) * (p.Hq if by_head else 1) * plane
    if p.bias is None:
        return nm * (1 + elt)
    return nm + 2 * p.B * p.Hq * plane * elt


BACKEND = SdpaBackend()
