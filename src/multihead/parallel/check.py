"""``python -m multihead.parallel check``: ring attention and tensor parallelism against one process.

A quick end-to-end test of a distributed set-up (two local processes, or every GPU of a torchrun job):
every rank builds the same global problem from one seed, runs the distributed path on its share and
compares with the same work done on one process.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .. import rng

__all__ = ["check_worker"]


def check_worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, float]:
    """Max errors of ring attention and of a tensor-parallel LM against the same work on one process."""
    import multihead as mh

    from .layout import shard
    from .ring import ring_attention
    from .tensor_parallel import tensor_parallel

    dev = torch.device(cfg["device"])
    B, H, Hkv, N, D = 2, 4, 2, 64 * world, 16
    with rng.private(0):  # every rank builds the same global problem and model (drawn on the CPU)
        q, k, v = (
            torch.randn(B, h, N, D, dtype=torch.float64).to(dev).requires_grad_() for h in (H, Hkv, Hkv)
        )
        lm = mh.TransformerLM(97, 64, 2, 4 * world, 128, n_kv_heads=2 * world).to(dev)
        ids = torch.randint(0, 97, (2, 17)).to(dev)
    errs: dict[str, float] = {}
    for name, mask, bias in (
        ("ring causal zigzag", mh.causal(), None),
        ("ring alibi", mh.causal(), mh.alibi(H)),
    ):
        ref = mh.attention(q, k, v, mask=mask, bias=bias, backend="reference")
        assert isinstance(ref, torch.Tensor)
        want = torch.autograd.grad(ref.sum(), (q, k, v))
        loc = [shard(t.detach(), layout="zigzag").requires_grad_() for t in (q, k, v)]
        out = ring_attention(*loc, mask=mask, bias=bias, layout="zigzag", timeout=cfg["timeout"])
        assert isinstance(out, torch.Tensor)
        got = torch.autograd.grad(out.sum(), loc)
        pairs = [(out.detach(), ref.detach()), *zip(got, want)]
        errs[name] = max((a - shard(b, layout="zigzag")).abs().max().item() for a, b in pairs)
    ref_lm = copy.deepcopy(lm)
    with torch.no_grad():
        want_logits = ref_lm(ids)
        got_logits = tensor_parallel(lm)(ids)
    errs["tensor-parallel LM logits"] = (got_logits - want_logits).abs().max().item()
    return errs
