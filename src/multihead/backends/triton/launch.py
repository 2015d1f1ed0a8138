"""Everything a kernel launch needs besides q, k, v: the plan, the score modifiers and the block sizes.

Shape legend: B batch, Hq query heads, Nq queries, Nk keys.

Score modifiers become data: ALiBi its (Hq,) slopes, every other additive bias (tensor biases, custom
biases) one fp32 tensor read through its strides (stride 0 on a broadcast dim), the soft-cap its value.
The compiled kernel depends only on the head dims, the dtype and which modifiers are present, never on
the mask or the lengths.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ...core.biases import ALiBi, Bias, CustomBias, SoftCap, TensorBias, bias_parts
from ...core.problem import Problem
from .plan import TilePlan, plan_for

__all__ = [
    "MAX_HEAD_DIM",
    "UNSPECIALISED",
    "Launch",
    "dummy",
    "last_dim_contiguous",
    "make_launch",
    "why_not_modifiers",
]

MAX_HEAD_DIM = 256
# The kernels' int arguments that Triton must not specialise: lengths, offsets, the scale and cap, and
# the strides of the mask's bit masks and of the bias, which change with the mask or the length (Triton
# would compile again when one changes its divisibility by 16). The q/k/v/o strides are specialised:
# their divisibility by 16 lets Triton emit 16-byte loads, and it does not change with the length
# when the head dim is a multiple of 16.
UNSPECIALISED = [
    "Hq", "G", "Nq", "Nk", "D", "Dv", "kbase", "scale", "cap", "sxb", "sxh", "sbb", "sbh", "sbq", "sbk",
]  # fmt: skip


def why_not_modifiers(p: Problem) -> str | None:
    """Why the kernels cannot apply ``p``'s bias (None when they can)."""
    parts = bias_parts(p.bias)
    caps = [i for i, b in enumerate(parts) if isinstance(b, SoftCap)]
    if len(caps) > 1:
        return "more than one soft-cap in the bias chain (the kernel applies one)"
    for part in parts:
        if not isinstance(part, SoftCap | ALiBi | TensorBias | CustomBias) and not part.is_additive:
            return f"{part!r} is not additive and not a soft-cap; the kernel has no form for it"
    if caps:
        before = [b for b in parts[: caps[0]] if b.is_additive]
        after = [b for b in parts[caps[0] + 1 :] if b.is_additive]
        if before and after:
            return "additive biases on both sides of the soft-cap (the kernel adds them on one side)"
    return None


@dataclass
class Launch:
    """The data and settings of one call's kernels (see the module docstring)."""

    problem: Problem
    scale: float
    cap: float
    softcap: bool
    bias_after_cap: bool
    has_alibi: bool
    has_bias: bool
    bias_tensor: Tensor  # (B|1, Hq|1, Nq|1, Nk|1) fp32, or a 1-element dummy
    bias_grad: bool  # bias_tensor requires grad: the dQ kernel accumulates its gradient
    bias_strides: tuple[int, ...]  # (4,) batch, head, row, key
    slope_tensor: Tensor  # (Hq,) fp32, or a 1-element dummy
    bd: int
    bdv: int
    even_d: bool  # the head dims fill their padded blocks (no column mask on q/k/v/o loads)
    precision: str
    fwd_blocks: tuple[int, int]
    dkdv_blocks: tuple[int, int]
    dq_blocks: tuple[int, int]
    fwd_warps: int
    fwd_stages: int
    bwd_warps: int
    bwd_stages: int
    plans: dict[tuple[int, int], TilePlan] = field(default_factory=dict)

    def plan(self, blocks: tuple[int, int]) -> TilePlan:
        if blocks not in self.plans:
            self.plans[blocks] = plan_for(self.problem, *blocks)
        return self.plans[blocks]


def dummy(like: Tensor) -> Tensor:
    """A one-element fp32 tensor for a pointer argument the kernel does not read."""
    return torch.zeros(1, dtype=torch.float32, device=like.device)


def last_dim_contiguous(t: Tensor) -> Tensor:
    """``t`` itself when its last dim has stride 1 (the kernels read rows as vectors), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def make_launch(p: Problem, interpret: bool) -> Launch:
    """The launch of ``p`` (its modifiers must pass :func:`why_not_modifiers`)."""
    parts = bias_parts(p.bias)
    cap_at = next((i for i, b in enumerate(parts) if isinstance(b, SoftCap)), None)
    cap = parts[cap_at].cap if cap_at is not None else 1.0  # type: ignore[attr-defined]
    slopes = [b.slopes for b in parts if isinstance(b, ALiBi)]
    others = [b for b in parts if b.is_additive and not isinstance(b, ALiBi)]
    dev = p.q.device
    bias_tensor = dummy(p.q)
    strides_t: tuple[int, ...] = (0, 0, 0, 0)
    if others:
        bias_tensor = _additive(others, p)  # (B|1, Hq|1, Nq|1, Nk|1)
        strides_t = tuple(st if n > 1 else 0 for st, n in zip(bias_tensor.stride(), bias_tensor.shape))
    slope_tensor = torch.stack(slopes).sum(0).to(dev, torch.float32) if slopes else dummy(p.q)  # (Hq,)
    bd, bdv = _pow2(p.D), _pow2(p.Dv)
    return Launch(
        problem=p,
        scale=p.scale,
        cap=cap,
        softcap=cap_at is not None,
        bias_after_cap=cap_at is not None and not any(b.is_additive for b in parts[:cap_at]),
        has_alibi=bool(slopes),
        has_bias=bool(others),
        bias_tensor=bias_tensor,
        bias_grad=bias_tensor.requires_grad,
        bias_strides=strides_t,
        slope_tensor=slope_tensor,
        bd=bd,
        bdv=bdv,
        even_d=bd == p.D and bdv == p.Dv,
        precision="ieee" if p.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding; 16-bit: MMA
        **_blocks(max(bd, bdv), interpret, p.dtype == torch.float32),
    )


def _additive(parts: list[Bias], p: Problem) -> Tensor:
    """The sum of additive biases as one fp32 tensor at its natural broadcast shape; when gradients are
    on and it depends on a tensor that requires grad (a tensor bias, or one a custom bias captures), a
    contiguous tensor still in the autograd graph, so that its gradient (the dQ kernel's ``dbias``) flows
    back to those tensors through torch."""
    ctx, dev = p.ctx, p.q.device
    total = parts[0].natural(ctx, dev, torch.float32)
    for part in parts[1:]:
        total = total + part.natural(ctx, dev, torch.float32)  # broadcast sum
    if torch.is_grad_enabled() and total.requires_grad:
        return total.contiguous()  # (B|1, Hq|1, Nq|1, Nk|1): dbias is allocated with its strides
    return total.detach()


@functools.cache
def _blocks(d: int, interpret: bool, fp32: bool) -> dict:
    """Block sizes and launch settings by padded head dim and dtype (small tiles in the interpreter,
    where they exercise the tile logic quickly; Hopper-tuned tiles on a GPU)."""
    if interpret:
        return dict(
            fwd_blocks=(32, 16), dkdv_blocks=(16, 32), dq_blocks=(16, 16),
            fwd_warps=4, fwd_stages=1, bwd_warps=4, bwd_stages=1,
        )  # fmt: skip
    if d <= 128 and not fp32:
        # Chosen on an H200 (a sweep of block settings, N=16384, D=128, bf16; BENCHMARKS.md): 64 x 64
        # forward tiles with 4 warps were 1.00x / 1.22x / 1.09x the 128 x 64, 8-warp tiles on causal /
        # window 1024 / 8 documents, and a 4-warp backward 1.70x / 1.51x / 1.45x the 8-warp one.
        fwd, warps, stages, bwd, bwd_warps = (64, 64), 4, 3, (64, 64), 4
    elif d <= 128:  # fp32 (exact products, no tensor cores): 4 warps spilled 24 KB a thread (sm_90)
        fwd, warps, stages, bwd, bwd_warps = (128, 64), 8, 3, (64, 64), 8
    else:
        fwd, warps, stages, bwd, bwd_warps = (64, 64), 8, 2, (32, 64), 8
    return dict(
        fwd_blocks=fwd, dkdv_blocks=bwd, dq_blocks=bwd,
        fwd_warps=warps, fwd_stages=stages, bwd_warps=bwd_warps, bwd_stages=2,
    )  # fmt: skip
