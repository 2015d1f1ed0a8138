"""A decode step of a LLaMA-style :class:`~multihead.TransformerLM` with one native call per layer.

A batch-1 decode step of a small model spends a large share of its time outside the matrix-vector
products: about 60 small tensor ops per layer (norms, rotary, the cache write, attention, residuals,
SwiGLU), each a few microseconds, and more once the weights streaming through the caches have evicted
the interpreter's working set (measured: a tiny op costs 27 us right after the weights of a layer went
by, 4.7 us warm). :func:`decode_step` runs each layer as one call of ``mh_decode_layer``
(``multihead/native/decode_layer.c``): the same equations, the native GEMV for the products, the same
bf16 rounding points as the eager modules, and the model's own dense :class:`~multihead.KVCache`
storage (it writes position p in place and advances the cache), so eager and native steps can follow
each other in one generation. The embedding lookup, the final norm and the output head stay in torch.

It serves the model shape of LLaMA, Mistral without a window, Qwen2 without biases, and SmolLM: pre-LN
RMSNorm, rotary positions (half-split or interleaved pairs), GQA / MQA / MHA self-attention with the
textbook scale, SwiGLU feed-forward, no biases, fp32, bf16 or fp16 weights on the CPU; and the call shape of
a greedy or sampled decode step: one row, one new token, a dense cache of the weights' dtype, no
gradient. :func:`why_not_model` and :func:`why_not_call` say what else stops it; the caller then runs
the eager step. That includes a forward hook or pre-hook on a module the native step replaces (the
embedding, a layer or anything inside one, the final norm) or on every module, registered at any time:
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
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from .. import native
from ..nn.attention import MultiHeadAttention
from ..nn.feed_forward import FeedForward
from ..nn.kv_cache import KVCache
from ..nn.layers import TransformerLayer
from ..nn.norms import RMSNorm
from ..nn.positions import RotaryEmbedding

__all__ = ["decode_step", "why_not_call", "why_not_model"]


def _linear_weight(m: nn.Module, name: str) -> tuple[Tensor | None, str | None]:
    if not isinstance(m, nn.Linear):
        return None, f"{name} is a {type(m).__name__}, not a linear layer with a plain weight"
    if m.bias is not None:
        return None, f"{name} has a bias (the native layer has none)"
    return m.weight, None


def _layer_reason(i: int, layer: nn.Module, dtype: torch.dtype, eps: float | None) -> str | None:
    """Why layer i cannot run natively, or None."""
    if type(layer) is not TransformerLayer:
        return f"layer {i} is a {type(layer).__name__}, not a TransformerLayer"
    if not layer.norm_first or layer.cross_attn is not None:
        return f"layer {i} is post-LN or has cross-attention (the native layer is pre-LN self-attention)"
    norms = (layer.attn_norm, layer.ffn_norm)
    if not all(type(n) is RMSNorm for n in norms):
        return f"layer {i} normalises with {type(layer.attn_norm).__name__}, not RMSNorm"
    if any(n.eps != eps for n in norms):
        return f"layer {i}'s norms use another eps than the final norm"
    attn, ffn = layer.self_attn, layer.ffn
    if type(attn) is not MultiHeadAttention:
        return f"layer {i}'s attention is a {type(attn).__name__}, not the textbook MultiHeadAttention"
    if attn.approx is not None or not isinstance(attn.backend, str):
        return f"layer {i}'s attention runs an approximation or a custom backend"
    if attn.sinks is not None or attn.score_scale is not None:
        return f"layer {i}'s attention has sinks or a non-default score scale"
    if not isinstance(attn.rotary, RotaryEmbedding):
        return f"layer {i}'s attention has no RotaryEmbedding"
    if type(ffn) is not FeedForward or ffn.activation != "swiglu":
        return f"layer {i}'s feed-forward is not SwiGLU"
    for name, m in (
        ("qkv_proj", attn.qkv_proj),
        ("o_proj", attn.o_proj),
        ("w1", ffn.w1),
        ("w3", ffn.w3),
        ("w2", ffn.w2),
    ):
        w, why = _linear_weight(m, f"layer {i}'s {name}")
        if why is not None:
            return why
        assert w is not None
        if w.dtype != dtype or not w.is_contiguous():
            return f"layer {i}'s {name} weight is {w.dtype}, strides {w.stride()} (needs contiguous {dtype})"
    for n in norms:
        if n.weight.dtype != dtype:
            return f"layer {i}'s norm weight is {n.weight.dtype}, not {dtype}"
    return None


def _hooks_reason(model: Any) -> str | None:
    """Which forward hook or pre-hook the native step would skip (on the embedding, a layer or any
    module inside one, the final norm, or registered for every module), or None."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return "a global forward hook is registered (the native step would skip it)"
    for name, m in (("the embedding", model.embed), ("the final norm", model.final_norm)):
        if m._forward_hooks or m._forward_pre_hooks:
            return f"{name} has forward hooks (the native step would skip them)"
    for i, layer in enumerate(model.layers):
        for name, m in layer.named_modules():
            if m._forward_hooks or m._forward_pre_hooks:
                where = f"layer {i}'s {name}" if name else f"layer {i}"
                return f"{where} has forward hooks (the native step would skip them)"
    return None


def _hooks_reason_cached(model: Any) -> str | None:
    """:func:`_hooks_reason`, scanned again only after a hook was registered somewhere.

    Every hook torch registers (module, global or tensor) takes its id from one counter,
    ``RemovableHandle.next_id``: while it stands still, no hook was added since the last scan. Only a
    scan that found none is kept, so a model whose hooks are removed again returns to native steps.
    """
    stamp = RemovableHandle.next_id
    if model.__dict__.get("_native_hooks_stamp") == stamp:
        return None
    reason = _hooks_reason(model)
    if reason is None:
        model.__dict__["_native_hooks_stamp"] = stamp
    return reason


def why_not_model(model: Any, *, hooks: bool = True) -> str | None:
    """Why ``model`` (a TransformerLM) cannot take native decode steps here, or None when it can.
    ``hooks=False`` leaves out the forward hooks (which :func:`why_not_call` checks at every call: they
    come and go after the model's structure is fixed)."""
    reason = native.unavailable()
    if reason is not None:
        return f"the native kernels are unavailable: {reason}"
    layers = getattr(model, "layers", None)
    if getattr(model, "positions", None) != "rotary" or layers is None or len(layers) == 0:
        return "the model is not a TransformerLM with rotary positions"
    if getattr(model, "sliding_window", None) is not None:
        return "the model attends through a sliding window"
    emb = getattr(model, "embed", None)
    if type(emb) is not nn.Embedding or getattr(model, "pos_embed", None) is not None:
        return "the input embedding is not a plain nn.Embedding"
    if emb.weight.stride(1) != 1:
        return "the embedding's rows are not contiguous"
    final = model.final_norm
    if type(final) is not RMSNorm:
        return f"the final norm is a {type(final).__name__}, not RMSNorm"
    dtype = final.weight.dtype
    if dtype not in native.dtypes() or final.weight.device.type != "cpu":
        return (
            f"the weights are {dtype} on {final.weight.device}; native steps take {list(native.dtypes())} "
            "on the CPU"
        )
    if emb.weight.dtype != dtype:
        return f"the embedding is {emb.weight.dtype}, the final norm {dtype}"
    for i, layer in enumerate(layers):
        reason = _layer_reason(i, layer, dtype, final.eps)
        if reason is not None:
            return reason
    return _hooks_reason(model) if hooks else None


def why_not_call(
    model: Any, ids: Tensor, attention_mask: Tensor | None, cache: list[KVCache] | None
) -> str | None:
    """Why this call of ``model.hidden_states`` is not a native decode step, or None when it is.
    Cheap: made on every call (the model's structure is :func:`why_not_model`'s, asked once; its
    forward hooks are scanned again only after a hook was registered anywhere)."""
    if cache is None or ids.shape != (1, 1):
        return "not a one-token, one-row cached call"
    if model.__dict__.get("_native_hooks_stamp") != RemovableHandle.next_id:  # a hook was registered
        hooked = _hooks_reason_cached(model)
        if hooked is not None:
            return hooked
    if torch.is_grad_enabled() and any(p.requires_grad for p in model.final_norm.parameters()):
        return "gradients are on"
    if attention_mask is not None and not bool(attention_mask.all()):
        return "the attention mask has padding"
    c = cache[0]
    checked = model.__dict__.get("_native_caches", ())  # weak references to the caches checked last
    if len(checked) != len(cache) or any(r() is not kv for r, kv in zip(checked, cache)):
        reason = _cache_reason(model, cache)
        if reason is not None:
            return reason
        model.__dict__["_native_caches"] = tuple(weakref.ref(kv) for kv in cache)
    if cache[-1].position != c.position:
        return "the layers' caches hold different numbers of positions"
    if c.position >= c.max_len:
        return f"the cache is full ({c.max_len} positions)"
    if ids.dtype not in (torch.int64, torch.int32) or not 0 <= int(ids) < model.vocab_size:
        return "the token id is not an integer in [0, vocab_size) (the eager step says why)"
    return None


def _cache_reason(model: Any, cache: list[KVCache]) -> str | None:
    """Why these caches cannot take native steps (their kind, dtype, device and layout; fixed when a
    cache is built, so asked once per list of caches), or None."""
    if len(cache) != len(model.layers):
        return f"{len(cache)} caches for {len(model.layers)} layers"
    dtype = model.final_norm.weight.dtype
    for kv in cache:
        if kv.kind != "dense" or kv.dtype != dtype or kv.k.device.type != "cpu":
            return f"the cache is {kv.kind} {kv.dtype}; native steps need a dense {dtype} cache on the CPU"
        if kv.position != cache[0].position:
            return "the layers' caches hold different numbers of positions"
        if not (kv.k.is_contiguous() and kv.v.is_contiguous()) or kv.k.shape[-1] != kv.v.shape[-1]:
            return "the cache storage is not contiguous (B, Hkv, max_len, D)"
    return None


def decode_step(model: Any, ids: Tensor, cache: list[KVCache]) -> Tensor:
    """The final-normed hidden state (1, 1, d) of token ``ids`` (1, 1) at position ``cache[0].position``,
    every layer's key and value written into ``cache`` at that position (and the caches advanced).

    The caller checked :func:`why_not_model` and :func:`why_not_call`.

    Raises:
        ValueError: the native library cannot allocate its scratch memory.
    """
    lib = native.library()
    assert lib is not None
    dtype = model.final_norm.weight.dtype
    kind = native.KIND[dtype]
    pos = int(cache[0].position)
    table = model.embed.weight  # (V, d)
    d = table.shape[1]
    x = torch.empty(d, dtype=dtype)  # (d,) the residual stream, updated in place
    row = table.stride(0) * table.element_size()
    ctypes.memmove(x.data_ptr(), table.data_ptr() + int(ids) * row, d * table.element_size())  # embedding
    tables: dict[int, tuple[Tensor, Tensor]] = {}  # layers usually share one RotaryEmbedding
    for layer, kv in zip(model.layers, cache):
        attn, ffn = layer.self_attn, layer.ffn
        rotary = attn.rotary
        if id(rotary) not in tables:
            tables[id(rotary)] = rotary._table(pos, 1, torch.float32, x.device)  # 2 x (1, D/2)
        cos, sin = tables[id(rotary)]
        D, Hq, Hkv = attn.head_dim, attn.n_heads, attn.n_kv_heads
        rc = lib.mh_decode_layer(
            x.data_ptr(),
            layer.attn_norm.weight.data_ptr(),
            attn.qkv_proj.weight.data_ptr(),
            attn.o_proj.weight.data_ptr(),
            layer.ffn_norm.weight.data_ptr(),
            ffn.w1.weight.data_ptr(),
            ffn.w3.weight.data_ptr(),
            ffn.w2.weight.data_ptr(),
            kv.k.data_ptr(),
            kv.v.data_ptr(),
            kv.k.stride(1),
            kv.v.stride(1),
            pos,
            cos.data_ptr(),
            sin.data_ptr(),
            int(rotary.interleaved),
            d,
            Hq,
            Hkv,
            D,
            ffn.d_ff,
            layer.attn_norm.eps,
            1.0 / math.sqrt(D),
            kind,
        )
        if rc != 0:
            raise ValueError("the native decode layer could not allocate its scratch memory")
        kv.advance(1)
    h = torch.empty(d, dtype=dtype)  # (d,)
    lib.mh_rms_norm(
        x.data_ptr(), model.final_norm.weight.data_ptr(), h.data_ptr(), d, model.final_norm.eps, kind
    )
    return h.view(1, 1, d)  # (1, 1, d)
