"""Cost of one decode step per head design: FLOPs, bytes read, KV-cache bytes per token, intensity.

Every design of :data:`multihead.variants.NAMES` replaces the self-attention of the same one-layer
TransformerLM; the row is one decode step of that attention sub-layer (batch ``batch``, one new token
against ``context`` cached ones):

    flops      matmul FLOPs counted by ``torch.utils.flop_counter.FlopCounterMode`` inside the attention
               module on the real step, the attention itself on the ``matrix`` backend (2 m k n per
               matmul, as everywhere in :mod:`multihead.cost`); a design that cannot use a KV cache
               recomputes the whole prefix at every step, and that is what it costs
    bytes      what the step must read at least: the module's weights once, plus each sequence's cache
               (``kv_bytes_per_token * context * batch``); a design that cannot use a KV cache recomputes
               keys and values from the inputs, so it reads ``d_model`` numbers per cached token instead
    intensity  flops / bytes: far below a processor's ridge (5-20 FLOP/byte on a CPU) means the step is
               bound by memory bandwidth, where a smaller cache (GQA, MQA, latent attention) pays off

Counting the real step keeps the rows true to each design's code (MoH's routing, talking heads' mixing,
differential attention's two maps, latent attention's absorbed decode) without a second, hand-written
formula per design.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from .. import rng
from ..core.checks import check_int

__all__ = ["DesignCost", "design_costs"]


@dataclass(frozen=True)
class DesignCost:
    """One design's decode step (attention sub-layer only)."""

    design: str
    flops: int
    bytes: int
    kv_bytes_per_token: int
    cached: bool
    params: int

    @property
    def intensity(self) -> float:
        """FLOPs per byte read."""
        return self.flops / self.bytes if self.bytes else 0.0

    def as_dict(self) -> dict:
        return {
            "design": self.design,
            "flops": self.flops,
            "bytes": self.bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "cached": self.cached,
            "params": self.params,
            "intensity": self.intensity,
        }


def design_costs(
    d_model: int = 512,
    n_heads: int = 8,
    context: int = 1024,
    *,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    names: tuple[str, ...] | None = None,
) -> list[DesignCost]:
    """One :class:`DesignCost` per design (default every name of :data:`multihead.variants.NAMES`).

    Args:
        d_model, n_heads: the layer's width and query heads (each design's own defaults otherwise).
        context: cached tokens the new one attends to.
        batch: sequences decoded together.
        dtype: the weights' and cache's dtype (bytes).
        names: the designs, default all.

    Raises:
        ValueError: a size below 1, an unknown design name, and what a design's constructor raises.
    """
    from ..heads.gqa import kv_cache_bytes_per_token
    from ..models.lm import TransformerLM
    from ..variants import NAMES, swap

    for name, val in (("d_model", d_model), ("n_heads", n_heads), ("context", context), ("batch", batch)):
        check_int(name, val, 1, owner="design_costs")
    names = NAMES if names is None else names
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ValueError(f"design_costs names {unknown} are not designs; choose among {list(NAMES)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = []
    for name in names:
        with rng.private(0):  # every design from the same weights; the caller's generator untouched
            base = TransformerLM(16, d_model, 1, n_heads, 2 * d_model, max_len=context + 1)
            lm = base if name == "mha" else swap(base, name, backend="matrix")
        assert isinstance(lm, TransformerLM)
        lm = lm.to(dtype).eval()
        attn = lm.layers[0].self_attn
        assert isinstance(attn, torch.nn.Module)
        setattr(attn, "backend", "matrix")  # noqa: B010 - every matmul where FlopCounterMode sees it
        cached = not getattr(attn, "no_cache", None)
        ids = torch.zeros(batch, context, dtype=torch.long)  # (B, context)
        step = torch.zeros(batch, 1, dtype=torch.long)  # (B, 1)
        with torch.no_grad():
            if cached:
                cache = lm.make_cache(batch, context + 1)
                lm(ids, cache=cache)
                counter = FlopCounterMode(display=False)
                with counter:
                    lm(step, cache=cache)
            else:
                counter = FlopCounterMode(display=False)
                with counter:
                    lm(torch.cat([ids, step], dim=1))  # (B, context + 1): recomputed every step
        flops = sum(
            sum(ops.values())
            for mod, ops in counter.get_flop_counts().items()
            if mod.endswith("layers.0.self_attn")
        )
        params = sum(int(p.numel()) for p in attn.parameters())
        per_token = kv_cache_bytes_per_token(lm, dtype) if cached else d_model * itemsize
        nbytes = params * itemsize + per_token * context * batch
        rows.append(DesignCost(name, int(flops), int(nbytes), int(per_token), cached, int(params)))
    return rows
