"""The kernels as one differentiable torch operation (forward kernel, backward kernels, sinks' gradient).

Shape legend: B batch, Hq query heads, Hkv kv heads, Nq queries, Nk keys, D / Dv head dims.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...core.numerics import sink_grad
from .backward import attention_backward
from .forward import attention_forward
from .launch import Launch

__all__ = ["triton_attention"]


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, bias: Tensor | None, run: Launch
    ) -> Any:
        """``bias`` is ``run.bias_tensor`` when it requires grad (an input here so that its gradient
        reaches the tensors it was built from), else None."""
        sinks32 = None if sinks is None else sinks.detach().float().contiguous()  # (Hq,)
        out, lse = attention_forward(q, k, v, sinks32, run)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.run = run
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> Any:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, delta, dbias = attention_backward(q, k, v, out, lse, dout, dlse, ctx.run)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = sink_grad(sinks, lse, delta)  # (Hq,)
        return dq, dk, dv, dsinks, dbias, None


def triton_attention(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, run: Launch
) -> tuple[Tensor, Tensor]:
    """``(out (B, Hq, Nq, Dv), lse (B, Hq, Nq) fp32)``; differentiable in q, k, v, sinks, the additive
    biases' tensors (``run.bias_grad``) and through lse.

    Rows no key reaches get output 0, lse -inf (``sink_h`` with sinks) and zero gradients.
    """
    bias = run.bias_tensor if run.bias_grad else None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks, bias)):
        return _TritonAttention.apply(q, k, v, sinks, bias, run)
    sinks32 = None if sinks is None else sinks.float().contiguous()  # (Hq,)
    return attention_forward(q, k, v, sinks32, run)
