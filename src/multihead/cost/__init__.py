"""Analytic cost of a Transformer, walked through eq. (1)-(13) of docs/equations.md.

    import multihead as mh
    c = mh.cost.estimate("llama-7b", batch=1, seq_len=2048, phase="decode")   # or a model, or a config
    c.flops, c.bytes, c.intensity, c.matmul_flops, c.memory()
    c.roofline(peak_flops, bandwidth)            # memory- or compute-bound, per row
    roof = mh.cost.measure_roof()                # this machine's matmul rate and memory bandwidth
    mh.cost.plot_roofline({"decode": c}, roof, "roofline.png")
    mh.cost.design_costs(512, 8, context=1024)   # one decode step of every head design: FLOPs, bytes, KV

Each step of a layer becomes an :class:`Op` row: its shapes, FLOPs, bytes moved and arithmetic intensity
(FLOPs per byte). :func:`estimate` walks a whole model - embedding, each kind of layer with its count,
final norm and LM head - on top of the same one-layer walk as :func:`layer_walk`.

Conventions:
    * A matmul (m x k) @ (k x n) costs ``2 m k n`` FLOPs (the convention of
      ``torch.utils.flop_counter``); bias adds ride in the matmul's epilogue and are not counted.
      ``Cost.matmul_flops`` is what ``FlopCounterMode`` counts on the real forward with the ``matrix``
      backend (eq. (2) as two batched matmuls). Fused kernels run the same dense math where the mask
      allows every block (``tiled`` skips masked blocks, so it does less), but FlopCounterMode does not
      see inside CPU ``sdpa``.
    * The model is *unfused*: every op reads its inputs and writes its output once, at ``dtype``'s size
      (weights included). The scores S and weights P are materialised (B, Hq, Nq, Nk) as in eq. (2),
      unmasked blocks included - the traffic a fused kernel (``sdpa``, ``tiled``) saves.
    * Elementwise FLOPs per element are rough documented counts (softmax 7, LayerNorm 7, RMSNorm 4,
      GELU 8, SiLU 4, SwiGLU 5, RoPE 3, residual add 1).
    * GQA/MQA: the K and V projections are ``Hkv * D`` wide and K/V are read once per kv head (never
      repeated); scores are still computed for all ``Hq`` query heads.
    * ``prefill``: Nq = seq_len new rows against Nk = cached + seq_len keys. ``decode``: one new row per
      sequence against Nk = cached + 1 keys read from the KV cache (at most ``window`` with a sliding
      window, the sliding cache's size). The LM head projects every new row, as ``forward`` does.

What the numbers say (docs/equations.md, section 6; tests/test_cost.py checks each):
    * Decode at batch 1 is memory-bound: every weight matmul multiplies a matrix by one vector, 2 FLOPs
      per weight element read - about 1 FLOP/byte at 16-bit, 0.5 at fp32 - far below the ridge of any
      CPU or GPU (roughly 5-20 FLOP/byte on a CPU, ~300 on an H100).
    * Batching B requests shares each weight read, so the projections' and FFN's intensity grows about
      B-fold toward compute-bound.
    * The attention matmuls (S = Q K^T, A = P V) multiply activations by each request's own K/V cache:
      nothing is shared, so their intensity stays near 1 FLOP/byte at 16-bit (just below 1 for MHA;
      about G = Hq/Hkv for GQA, whose kv heads serve G query heads) at any batch size.

Shape legend: B batch, Nq new rows, Nk keys, d = d_model, Hq / Hkv query / kv heads, D head dim, F = d_ff,
V vocabulary.
"""

from __future__ import annotations

from .configs import PRESETS, as_shape, from_config, load_config, preset
from .designs import DesignCost, design_costs
from .estimate import Cost, estimate
from .kv import KVVariant, compare_kv_heads, kv_cache_bytes
from .ops import Call, Op, total
from .plot import plot_roofline
from .roofline import Roof, RooflinePoint, measure_roof, roofline
from .shapes import ModelShape, from_model
from .walk import LayerSpec, layer_walk, walk_layer

__all__ = [
    "PRESETS",
    "Call",
    "Cost",
    "DesignCost",
    "KVVariant",
    "LayerSpec",
    "ModelShape",
    "Op",
    "Roof",
    "RooflinePoint",
    "as_shape",
    "compare_kv_heads",
    "design_costs",
    "estimate",
    "from_config",
    "from_model",
    "kv_cache_bytes",
    "layer_walk",
    "load_config",
    "measure_roof",
    "plot_roofline",
    "preset",
    "roofline",
    "total",
    "walk_layer",
]
