"""A decode step of a LLaMA-style :class:`~multihead.TransformerLM` in one native call for all its layers.

A batch-1 decode step of a small model spends a large share of its time outside the matrix-vector
products: about 60 small tensor ops per layer (norms, rotary, the cache write, attention, residuals,
SwiGLU), each a few microseconds, and more once the weights streaming through the caches have evicted
the interpreter's working set. :func:`decode_step` runs every layer in one call of ``mh_decode_layers``
(``multihead/native/decode_layer.c``): the same equations, the native GEMV for the products, the same
bf16 rounding points as the eager modules, and the model's own dense :class:`~multihead.KVCache`
storage (it writes position p in place and advances the cache), so eager and native steps can follow
each other in one generation. The final norm runs in the same call; the output head stays in torch,
except in a greedy run (:mod:`.native_greedy`: up to 8 greedy tokens in one native call).

It serves the model shape of LLaMA, Mistral without a window, Qwen2 without biases, and SmolLM: pre-LN
RMSNorm, rotary positions (half-split or interleaved pairs), GQA / MQA / MHA self-attention with the
textbook scale, SwiGLU feed-forward, no biases, fp32, bf16 or fp16 weights on the CPU; and the call shape of
a greedy or sampled decode step: one row, one new token, a dense cache of the weights' dtype, no
gradient. :func:`~.native_fits.why_not_model` and :func:`~.native_fits.why_not_call` say what else
stops it; the caller then runs the eager step. That includes a forward hook or pre-hook on a module the
native step replaces (the embedding, a layer or anything inside one, the final norm) or on every module,
registered at any time:
the call checks torch's hook counter at every step and scans the modules again only when it moved.
``mh.quant.quantize(model, weights="fp32" | "bf16" | "fp16", kernel="native")`` turns it on ("auto"
picks native for a TransformerLM).

Shape legend: d model width, Hq / Hkv query / kv heads, D head dim, F feed-forward width, V vocabulary.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from .. import native
from ..native import hugepages
from ..nn.kv_cache import KVCache
from ..nn.positions import RotaryEmbedding
from .gguf_linear import GGUFLinear
from .int8_gemv_linear import Int8GemvLinear
from .native_fits import (
    GG_LAYOUT,
    ONE_ID,
    PROMPT_INT8,
    ROWS_FLOAT,
    ROWS_INT8,
    gguf_layout,
    layer_projections,
    why_not_call,
    why_not_model,
)

__all__ = [
    "ONE_ID",
    "PROMPT_INT8",
    "ROWS_FLOAT",
    "ROWS_INT8",
    "decode_step",
    "huge_pages",
    "why_not_call",
    "why_not_model",
]  # why_not_call / why_not_model: native_fits's, here for the callers that ask this module


def huge_pages(model: Any) -> int:
    """Back the float weights a decode step streams (every layer's projections and the head) with 2 MiB pages
    in place (:func:`multihead.native.hugepages.collapse`; a decode step reads them at up to 1.6x the
    rate where the TLB would otherwise miss every 4 KiB), each storage once per model. Returns the bytes
    collapsed by this call."""
    done: set[int] = model.__dict__.setdefault("_native_hugepages", set())
    # float projections; int8 and GGUF-block ones were moved to 2 MiB pages by their quantizer or loader
    weights = [
        m.weight for layer in model.layers for m in layer_projections(layer) if isinstance(m, nn.Linear)
    ]
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        weights.append(model.lm_head.weight)
    fresh = [w for w in weights if w.untyped_storage().data_ptr() not in done]
    done.update(w.untyped_storage().data_ptr() for w in fresh)
    return hugepages.collapse(fresh)


class Plan:
    """The arguments every step of one generation passes the native layers, gathered once per list of
    caches (as the model's structure is checked once per generation): the library to call, one
    :class:`~multihead.native.LayerArgs` per layer, and per layer its rotary table's owner. The weight
    tensors are held, so their memory outlives the plan; a step checks their addresses."""

    def __init__(self, model: Any, cache: list[KVCache], lib: ctypes.CDLL):
        self.cache, self.lib = weakref.ref(cache[0]), lib
        self.dtype = model.final_norm.weight.dtype
        n = len(model.layers)
        self.args = (native.LayerArgs * n)()
        self.cos, self.sin = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()  # a step's rotary rows
        self.done = ctypes.c_int64(0)
        self.rotaries: list[RotaryEmbedding] = []
        self.weights: list[Tensor] = [model.final_norm.weight]
        for a, layer, kv in zip(self.args, model.layers, cache):
            attn, ffn = layer.self_attn, layer.ffn
            self.rotaries.append(attn.rotary)
            norms = (layer.attn_norm.weight, layer.ffn_norm.weight)
            projections = layer_projections(layer)
            int8 = [isinstance(m, (Int8GemvLinear, GGUFLinear)) for m in projections]
            kernel = [kernel_tensors_of(m) for m in projections]
            ws, scales = [k[0] for k in kernel], [k[1] for k in kernel if k[1] is not None]
            self.weights += [*norms, *ws, *scales]
            a.g_attn, a.g_ffn = (t.data_ptr() for t in norms)
            a.w[:] = [t.data_ptr() for t in ws]
            a.s[:] = [None if k[1] is None else k[1].data_ptr() for k in kernel]  # packed: the rows again
            a.group = getattr(projections[0], "group_size", None) or 1 << 62  # per row: G >= any width
            layouts = {k[2] for k, q in zip(kernel, int8) if q}
            a.gg_types = 0
            if layouts and min(layouts) >= GG_LAYOUT:  # GGUF blocks: each projection's own type
                a.gg_types = sum((k[2] - GG_LAYOUT) << (4 * p) for p, k in enumerate(kernel))
                layouts = {kernel[0][2]}
            if len(layouts) > 1:  # why_not_model saw one layout; set_packed on some linears since
                raise ValueError(
                    f"layer {len(self.rotaries) - 1}'s int8 linears have rows in {len(layouts)} layouts; "
                    "call set_packed with the same value on all of a model's Int8GemvLinear modules"
                )
            a.blocked = layouts.pop() if layouts else 0
            a.k_cache, a.v_cache = kv.k.data_ptr(), kv.v.data_ptr()
            a.k_head_stride, a.v_head_stride = kv.k.stride(1), kv.v.stride(1)
            if kv.k_scale is not None and kv.v_scale is not None:  # an int8 cache
                a.k_scale, a.v_scale = kv.k_scale.data_ptr(), kv.v_scale.data_ptr()
                a.s_head_stride = kv.k_scale.stride(1)
            a.d, a.Hq, a.Hkv = norms[0].shape[0], attn.n_heads, attn.n_kv_heads
            a.D, a.F = attn.head_dim, ffn.d_ff
            a.eps, a.scale = layer.attn_norm.eps, 1.0 / math.sqrt(attn.head_dim)
            a.interleaved, a.kind = int(attn.rotary.interleaved), native.KIND[self.dtype]
        self.addresses = [t.data_ptr() for t in self.weights]
        self.eps = model.final_norm.eps

    def fits(self, cache: list[KVCache]) -> bool:
        """Whether this plan is of these caches and every weight still lies where it did."""
        return self.cache() is cache[0] and list(map(Tensor.data_ptr, self.weights)) == self.addresses


def kernel_tensors_of(m: Any) -> tuple[Tensor, Tensor | None, int]:
    """What a native layer reads of a projection: (weight, int8 scales or None, layout); GGUF blocks are
    their own scales (a non-NULL pointer) in layout GG_LAYOUT + their type."""
    if isinstance(m, GGUFLinear):
        return m.blocks, m.blocks, gguf_layout(m)
    return m.kernel_tensors() if isinstance(m, Int8GemvLinear) else (m.weight, None, 0)


def plan_for(model: Any, cache: list[KVCache], lib: ctypes.CDLL) -> Plan:
    plan = model.__dict__.get("_native_plan")
    if plan is None or not plan.fits(cache):
        plan = model.__dict__["_native_plan"] = Plan(model, cache, lib)
    return plan


def decode_step(model: Any, ids: Tensor, cache: list[KVCache]) -> Tensor:
    """The final-normed hidden states of ``ids`` at position ``cache[0].position`` on: (B, 1, d) for one
    token of each of B rows (every row at that position: a batch without padding), or (1, N, d) for N
    tokens of one row (a prompt, run in chunks of up to ``ROWS_INT8`` tokens); every layer's keys and values
    written into ``cache`` there (and the caches advanced). Each row has the bits a one-token step of it
    alone gives it: several rows run the multi-row products, which read the weights once for all of them,
    and a prompt's token attends to the positions up to its own, as its step would.

    The caller checked :func:`why_not_model` and :func:`why_not_call`. The layers' arguments are
    gathered at the first step of each list of caches; a step is then one native call for all the layers.

    Raises:
        ValueError: the native library cannot allocate its scratch memory.
    """
    if ids.shape[1] == 1:
        return _rows(model, ids, cache, seq=False)  # (B, 1, d)
    chunks = ids.split(ROWS_INT8, dim=1)  # (1, <= ROWS_INT8) each
    return torch.cat(
        [_rows(model, c.reshape(-1, 1), cache, seq=True).view(1, c.shape[1], -1) for c in chunks], 1
    )


def _rows(model: Any, ids: Tensor, cache: list[KVCache], seq: bool) -> Tensor:
    """One native call for the R tokens ``ids`` (R, 1): R rows at one position, or (``seq``) R consecutive
    tokens of one row. Returns their final-normed states (R, 1, d)."""
    lib = native.library()
    assert lib is not None
    plan = plan_for(model, cache, lib)
    pos = int(cache[0].position)
    x = embedding_rows(model, ids, plan.dtype)  # (R, d) the residual stream, updated in place
    xp, (R, d) = x.data_ptr(), x.shape
    tables = rotary_rows(plan, pos, R if seq else 1)  # rows of kept tables: their addresses stay valid
    n = len(plan.rotaries)
    if len(tables) == 1:
        cos, sin = next(iter(tables.values()))
        plan.cos[:], plan.sin[:] = [cos.data_ptr()] * n, [sin.data_ptr()] * n
    else:
        plan.cos[:] = [tables[id(r)][0].data_ptr() for r in plan.rotaries]
        plan.sin[:] = [tables[id(r)][1].data_ptr() for r in plan.rotaries]
    h = torch.empty(R, d, dtype=plan.dtype)  # (R, d) the final norm of x
    final, done = (plan.addresses[0], plan.eps, h.data_ptr()), ctypes.byref(plan.done)
    if R == 1:
        status = plan.lib.mh_decode_layers(xp, plan.args, n, pos, plan.cos, plan.sin, *final, done)
    else:
        status = plan.lib.mh_decode_batch(
            xp, plan.args, n, pos, plan.cos, plan.sin, *final, done, R, int(seq)
        )
    for kv in cache[: plan.done.value]:
        kv.advance(R if seq else 1)
    if status != 0:  # -2 cannot happen: why_not_model checked the weights against the build
        raise ValueError("the native decode layers could not allocate their scratch memory")
    return h.view(R, 1, d)  # (R, 1, d)


def rotary_rows(plan: Plan, pos: int, n: int) -> dict[int, tuple[Tensor, Tensor]]:
    """Each distinct rotary table's cos and sin rows ``pos .. pos + n - 1`` (fp32, 2 x (n, D/2)), keyed by
    the table owner's id (layers usually share one RotaryEmbedding)."""
    tables: dict[int, tuple[Tensor, Tensor]] = {}
    for rotary in plan.rotaries:
        if id(rotary) not in tables:
            tables[id(rotary)] = rotary._table(pos, n, torch.float32, torch.device("cpu"))
    return tables


def embedding_rows(model: Any, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """The input embeddings of the R tokens ``ids`` (R, 1), a fresh contiguous (R, d) tensor. One token: a
    row copy of a float table or an int8 table's row dequantized natively (a few microseconds fewer of the
    interpreter a step); several, and other tables: the embedding module's lookup (the same values)."""
    emb = model.embed
    if ids.numel() == 1 and type(emb) is nn.Embedding:
        table = emb.weight  # (V, d)
        x = torch.empty(1, table.shape[1], dtype=dtype)  # (1, d)
        stride = table.stride(0) * table.element_size()
        ctypes.memmove(
            x.data_ptr(), table.data_ptr() + int(ids) * stride, table.shape[1] * table.element_size()
        )
        return x
    native_row = getattr(emb, "native_row", None)  # an int8 table's row in one native call
    one = (
        native_row(int(ids))
        if ids.numel() == 1 and native_row is not None and dtype == torch.float32
        else None
    )
    return emb(ids.view(-1)).to(dtype).contiguous() if one is None else one.view(1, -1)  # (R, d)
