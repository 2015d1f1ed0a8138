"""The ``tiled`` backend: the project's own block-sparse kernel, O(N) extra memory, any mask or bias.

Shape legend: B batch, Hq query heads, Nq query rows, Dv value width; tiles are ``block_q`` x ``block_k``.

The mask's tile grid is classified once per problem (:meth:`Problem.grid`): EMPTY tiles are skipped,
FULL tiles need no per-element mask. Two engines run it, and :meth:`TiledBackend.run` chooses:

* the fused engine (:mod:`.fused`, whenever it can): the grid cut into pieces (:mod:`.plan`) - a sliding
  window or a causal diagonal is one batched call over strided views of K/V - each one call of torch's
  fused CPU flash kernel, merged exactly by their log-sum-exp (:mod:`.merge`). Parallel over batch x
  heads x blocks inside the kernel; bf16 inputs accumulate in fp32.
* the loop engine (:mod:`.loop`): the online softmax one tile at a time in torch ops, for what the
  fused kernel cannot do - dropout, soft-capping, gradients into a tensor bias, non-CPU devices.
"""

from __future__ import annotations

import torch

from ...core.biases import CustomBias, bias_parts
from ...core.numerics import acc_dtype
from ...core.problem import AttentionOutput, Problem
from ...core.tiles import Grid
from .fused import run_fused, why_not_fused
from .loop import run_loop
from .plan import Piece, pieces

__all__ = ["BACKEND", "BLOCK_K", "BLOCK_Q", "TiledBackend"]

BLOCK_Q = 64
BLOCK_K = 64


class TiledBackend:
    name = "tiled"
    summary = (
        "own block-sparse kernel: tiles classified from the mask, empty ones skipped, the rest as a few "
        "fused calls merged by log-sum-exp; O(N) memory, native GQA, any mask or bias"
    )

    def __init__(self, block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
        self.block_q, self.block_k = block_q, block_k

    def why_not(self, p: Problem) -> str | None:
        if p.return_weights:
            return "the tiled kernel never materialises the weights"
        if torch.is_grad_enabled() and any(isinstance(b, CustomBias) for b in bias_parts(p.bias)):
            return (
                "gradients into tensors a custom_bias fn captures cannot be routed through the tiled "
                "backward (only tensor biases are); run under torch.no_grad() or pass the tensor as bias="
            )
        return None

    def grid(self, p: Problem) -> Grid:
        """The tile grid of ``p`` with this backend's block sizes."""
        return p.grid(self.block_q, self.block_k)

    def plan(self, p: Problem) -> list[Piece]:
        """The fused engine's pieces for ``p`` (what :meth:`run` executes when the engine applies)."""
        return pieces(self.grid(p), p.mask, p.bias, p.ctx, p.Hq)

    def run(self, p: Problem) -> AttentionOutput:
        """Attention for ``p`` on the fused engine when it can serve the call, else on the loop engine.

        Raises:
            ValueError: if the weights are requested.
        """
        if p.return_weights:
            raise ValueError("backend 'tiled' cannot return the attention weights; use backend='matrix'")
        if p.Nq == 0:
            out = p.q.new_zeros(p.B, p.Hq, 0, p.Dv)  # (B, Hq, 0, Dv)
            return AttentionOutput(out, None, p.q.new_zeros(p.B, p.Hq, 0, dtype=acc_dtype(p.dtype)))
        if why_not_fused(p) is None:
            out, lse = run_fused(p, self.plan(p))
        else:
            out, lse = run_loop(p, self.grid(p))
        return AttentionOutput(out, None, lse if p.return_lse else None)


BACKEND = TiledBackend()
