"""The ``triton`` backend: the library's own fused GPU kernels for every mask and bias, forward and backward.

Shape legend: B batch, Hq query heads, Nq queries, Nk keys, Dv value head dim.

Registered where the kernels can run: with CUDA and Triton installed, and on the CPU when
``TRITON_INTERPRET=1`` is set (Triton's interpreter runs the same kernels on CPU tensors, slowly: for
tests). ``auto`` considers it on CUDA only.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from ...core.problem import AttentionOutput, Problem
from .launch import MAX_HEAD_DIM, make_launch, why_not_modifiers

__all__ = ["BACKEND", "TritonBackend", "interpret_requested", "should_register"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KERNELS = __package__ + ".forward"


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set (Triton then interprets kernels decorated from now on)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernels_interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter: as they were loaded, or as they would load now.

    Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when :mod:`.forward` is imported
    (on the first call), so a process keeps the mode of its first call.
    """
    module = sys.modules.get(_KERNELS)
    if module is None:
        return interpret_requested()
    return bool(module.INTERPRETED)


def should_register() -> bool:
    """Register where the kernels can run: CUDA with Triton, or the CPU with ``TRITON_INTERPRET=1``."""
    return triton_installed() and (torch.cuda.is_available() or interpret_requested())


class TritonBackend:
    name = "triton"
    summary = (
        "own fused Triton kernels (forward + backward): tile lists from the mask, empty tiles skipped, "
        "partial tiles as bit masks, native GQA, ALiBi / soft-cap / biases / sinks; CUDA"
    )

    def why_not(self, p: Problem) -> str | None:
        where = self._why_not_device(p)
        if where is not None:
            return where
        if p.return_weights:
            return "the Triton kernel never materialises the weights"
        if p.dropout_p > 0.0:
            return f"dropout_p={p.dropout_p}: the Triton kernel has no dropout (tiled and matrix do)"
        if p.dtype not in _DTYPES:
            return f"{p.dtype} inputs: the Triton kernel takes float16, bfloat16 and float32"
        if max(p.D, p.Dv) > MAX_HEAD_DIM:
            return f"head dims D={p.D}, Dv={p.Dv}: the Triton kernel takes up to {MAX_HEAD_DIM}"
        return why_not_modifiers(p)

    def _why_not_device(self, p: Problem) -> str | None:
        if not triton_installed():
            return "Triton is not installed (pip install triton; it ships with PyTorch's CUDA wheels)"
        dev = p.q.device.type
        if dev == "cpu" and not kernels_interpreted():
            return (
                "on the CPU the Triton kernels run only in Triton's interpreter: set TRITON_INTERPRET=1 "
                "before the first call (slow; meant for tests)"
            )
        if dev == "cuda" and kernels_interpreted():
            return (
                "the Triton kernels were loaded in the interpreter (TRITON_INTERPRET=1), which serves CPU "
                "tensors"
            )
        if dev not in ("cpu", "cuda"):
            return f"tensors on {p.q.device}: the Triton kernels run on CUDA GPUs (or the CPU interpreter)"
        return None

    def run(self, p: Problem) -> AttentionOutput:
        """Attention for ``p`` on the Triton kernels (differentiable in q, k, v and sinks).

        Raises:
            ValueError: when the kernels cannot serve ``p`` (the message is :meth:`why_not`'s reason).
        """
        reason = self.why_not(p)
        if reason is not None:
            raise ValueError(f"backend 'triton' cannot serve this call: {reason}")
        if p.Nq == 0:
            out = p.q.new_zeros(p.B, p.Hq, 0, p.Dv)  # (B, Hq, 0, Dv)
            return AttentionOutput(out, None, p.q.new_zeros(p.B, p.Hq, 0, dtype=torch.float32))
        from .function import triton_attention  # imports Triton and decorates the kernels

        run = make_launch(p, kernels_interpreted())
        out, lse = triton_attention(p.q, p.k, p.v, p.sinks, run)
        return AttentionOutput(out, None, lse if p.return_lse else None)


BACKEND = TritonBackend()
