"""``flex``: PyTorch's ``flex_attention`` compiled with ``torch.compile`` - optional, never required.

Shape legend: B, Hq, Hkv, Nq, Nk, D as in :mod:`multihead.core.problem`.

Our masks are already flex ``mask_mod`` predicates and our additive biases and soft-cap are ``score_mod``
functions, so the adapter is thin::

    mask_mod(b, h, q_idx, kv_idx)        = mask.evaluate(b, h, q_idx, kv_idx, ctx)
    score_mod(score, b, h, q_idx, kv_idx) = bias.apply(score, b, h, q_idx, kv_idx, ctx)

flex compiles one kernel per mask/score function and shape (about 30 s on a 2-core CPU), has no CPU
backward in every torch build and was not measured faster than ``tiled`` on CPU, so ``auto`` never picks
it; ask for it with ``backend="flex"``. It is registered only where it can be useful: with CUDA, or on
CPU when ``MULTIHEAD_FLEX=1`` is set (so that tests and the study do not compile on every machine).

Attention sinks have no mask_mod / score_mod form (they are a column that no key holds), so they are
merged from flex's returned log-sum-exp, in torch ops that autograd differentiates
(:func:`multihead.core.numerics.add_sink`): ``lse' = logaddexp(lse, sink_h)``, ``out' = out *
exp(lse - lse')``. Compiled flex on CPU returns no lse, so there sinks are refused.

Block masks are built once per mask and shape and reused from a bounded cache, from the masks' analytic
tile kinds where they have them (:mod:`multihead.backends.flex_blocks`).
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Any

import torch

from ..core.numerics import acc_dtype, add_sink
from ..core.placement import on_device
from ..core.problem import AttentionOutput, Problem
from .flex_blocks import block_mask_for

# torch.compile recompiles flex_attention for each new shape, dtype and mask/score function, and after
# dynamo's recompile limit (8 by default) it silently falls back to flex's unfused eager path, which
# materialises the N x N scores ("flex_attention called without torch.compile()"). A model called at
# many sequence lengths passes 8 quickly (seen on an H200: the ninth mask/shape ran unfused), so our
# calls raise the limit for flex alone, inside the call; the user's own dynamo setting is unchanged.
RECOMPILE_LIMIT = 128


@functools.cache
def _compiled() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _recompile_limit() -> Any:
    """A context that lets dynamo compile flex_attention up to :data:`RECOMPILE_LIMIT` times."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    current = getattr(dynamo_config, name)
    return dynamo_config.patch(**{name: max(current, RECOMPILE_LIMIT)})


def returns_lse(device: torch.device) -> bool:
    """Whether compiled flex_attention returns the log-sum-exp on ``device`` (not on CPU)."""
    return device.type != "cpu"


class FlexBackend:
    name = "flex"
    summary = "torch.nn.attention.flex_attention under torch.compile (block-sparse; best on GPU)"

    def unusable(self) -> str | None:
        """Why flex cannot run on this machine at all, or None."""
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError:
            return "this torch has no torch.nn.attention.flex_attention"
        if not torch.cuda.is_available() and shutil.which(os.environ.get("CXX", "g++")) is None:
            return "torch.compile needs a C++ compiler on CPU and none was found"
        return None

    def why_not(self, p: Problem) -> str | None:
        reason = self.unusable() or self._cannot(p)
        if reason is not None:
            return reason
        return "compiled flex_attention is opt-in (compile time per mask and shape); ask with backend='flex'"

    def _cannot(self, p: Problem) -> str | None:
        if p.return_weights:
            return "flex_attention cannot return the attention weights"
        if p.dropout_p > 0.0:
            return "flex_attention has no dropout"
        if p.q.device.type == "cpu" and p.needs_grad:
            return "flex_attention compiled on CPU supports inference only (no backward)"
        if p.return_lse and not returns_lse(p.q.device):
            return "flex_attention compiled on CPU cannot return the log-sum-exp"
        if p.sinks is not None and not returns_lse(p.q.device):
            return (
                "flex_attention compiled on CPU returns no log-sum-exp, and the attention sinks are merged "
                "through it; use backend='tiled' (or 'auto') for sinks on CPU"
            )
        return None

    def run(self, p: Problem) -> AttentionOutput:
        """Run ``p`` through compiled flex_attention.

        Raises:
            ValueError: when flex is unusable here or cannot serve the request (the message says why).
        """
        reason = self.unusable() or self._cannot(p)
        if reason is not None:
            raise ValueError(f"backend 'flex' cannot serve this call: {reason}")
        ctx = p.ctx
        block_mask, score_mod = None, None
        if p.mask is not None:  # built once per mask and shape (flex_blocks.CACHE)
            block_mask = block_mask_for(p.mask, ctx, p.q.device)
        if p.bias is not None:
            bias = on_device(p.bias, p.q.device)

            def score_mod(score, b, h, q_idx, kv_idx):
                return bias.apply(score, b, h, q_idx, kv_idx, ctx)

        want_lse = p.return_lse or p.sinks is not None
        with _recompile_limit():
            res = _compiled()(
                p.q, p.k, p.v, score_mod=score_mod, block_mask=block_mask, scale=p.scale,
                enable_gqa=p.Hq != p.Hkv, return_lse=want_lse,
            )  # fmt: skip
        out, lse = res if want_lse else (res, None)
        out = torch.nan_to_num(out, nan=0.0)  # a row with no allowed key returns zeros
        if lse is not None:
            out = out.masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0)
            lse = lse.to(acc_dtype(p.dtype))
        if p.sinks is not None:
            assert lse is not None
            o, lse = add_sink(out.to(lse.dtype), lse, p.sinks)  # (B, Hq, Nq, Dv), (B, Hq, Nq)
            out = o.to(p.dtype)
        return AttentionOutput(out, None, lse if p.return_lse else None)


BACKEND = FlexBackend()


def should_register() -> bool:
    """Register in the backend list only where flex can run and is wanted (see the module docstring)."""
    wanted = torch.cuda.is_available() or os.environ.get("MULTIHEAD_FLEX") == "1"
    return wanted and BACKEND.unusable() is None
