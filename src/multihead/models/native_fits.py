"""Whether a decode step of a :class:`~multihead.TransformerLM` can run natively
(:mod:`.native_step`), and why not: :func:`why_not_model` for the model's structure (asked once per
generation) and :func:`why_not_call` for each call (cheap: made on every step).

Shape legend: d model width, Hq / Hkv query / kv heads, D head dim.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from .. import native
from ..native import gguf_blocks
from ..native import int8 as native_int8
from ..nn.attention import MultiHeadAttention
from ..nn.feed_forward import FeedForward
from ..nn.kv_cache import KVCache
from ..nn.layers import TransformerLayer
from ..nn.norms import RMSNorm
from ..nn.positions import RotaryEmbedding
from .gguf_linear import GGUFEmbedding, GGUFLinear
from .int8_gemv_linear import Int8GemvLinear

__all__ = ["GG_LAYOUT", "ONE_ID", "PROMPT_INT8", "ROWS_FLOAT", "ROWS_INT8", "why_not_call", "why_not_model"]

#: a token id (1, 1) to ask whether a decode step would run natively (a greedy run picks ids in range)
ONE_ID = torch.zeros(1, 1, dtype=torch.long)

_PROJECTIONS = ("qkv_proj", "o_proj", "w1", "w3", "w2")  # the order of the native layer's weights

#: the most rows of one native call: with int8 weights as many as the multi-row product rounds and holds
#: at once (a longer prompt runs in chunks of as many tokens); with float weights (each block of rows met
#: by every row in turn) as many as ran faster than the eager layers when measured, and a float prompt
#: longer than that runs the eager layers; an int8 prompt runs natively up to ``PROMPT_INT8`` tokens
#: (past that the native attention, one query row at a time, costs more than the eager layers save)
ROWS_INT8, ROWS_FLOAT, PROMPT_INT8 = 64, 16, 512


def layer_projections(layer: Any) -> list[Any]:
    attn, ffn = layer.self_attn, layer.ffn
    return [attn.qkv_proj, attn.o_proj, ffn.w1, ffn.w3, ffn.w2]


#: the layout number of GGUF-block weights of ggml type T in a native layer: GG_LAYOUT + T (native.h)
GG_LAYOUT = 16


def gguf_layout(m: GGUFLinear) -> int:
    return GG_LAYOUT + gguf_blocks.KINDS[m.kind][0]


def _linear_weight(m: nn.Module, name: str, group: Any) -> tuple[Tensor | None, str | None]:
    """The weight of a float linear (``group`` None), the int8 weight of an Int8GemvLinear with
    ``group_size == group[0]``, or the blocks of a GGUFLinear of layout ``group[1]`` (>= GG_LAYOUT); or
    why not."""
    gg = group is not None and group[1] >= GG_LAYOUT
    want = nn.Linear if group is None else (GGUFLinear if gg else Int8GemvLinear)
    if not isinstance(m, want):
        kind = "a plain nn.Linear" if group is None else f"a {want.__name__}"
        return None, f"{name} is a {type(m).__name__}, not {kind}"
    if isinstance(m, GGUFLinear):  # each projection in its own block kind (a Q4_K_M file mixes them)
        if m.bias is not None:
            return None, f"{name} has a bias (the native layer has none)"
        return m.blocks, None
    if m.bias is not None:
        return None, f"{name} has a bias (the native layer has none)"
    if isinstance(m, Int8GemvLinear):
        if m.group_size != group[0]:
            return None, f"{name} has group size {m.group_size}, another layer {group[0]}"
        w, _, how = m.kernel_tensors()
        if how != group[1]:
            names = native_int8.LAYOUTS
            return None, f"{name} has {names[how]} int8 rows, another projection {names[group[1]]}"
        return w, None
    return m.weight, None


def _layer_reason(
    i: int, layer: nn.Module, dtype: torch.dtype, eps: float | None, group: Any, kv_approx: type | None
) -> str | None:
    """Why layer i cannot run natively, or None. ``group``: None for float weights, else (group_size,)
    of the int8 ones; ``kv_approx``: the approximation type every attention runs with an int8 cache."""
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
    if kv_approx is not None:
        if not isinstance(attn.approx, kv_approx):
            return f"layer {i}'s attention does not run {kv_approx.__name__} (the int8 cache's attention)"
    elif attn.approx is not None or not isinstance(attn.backend, str):
        return f"layer {i}'s attention runs an approximation or a custom backend"
    if attn.sinks is not None or attn.score_scale is not None:
        return f"layer {i}'s attention has sinks or a non-default score scale"
    if not isinstance(attn.rotary, RotaryEmbedding):
        return f"layer {i}'s attention has no RotaryEmbedding"
    if type(ffn) is not FeedForward or ffn.activation != "swiglu":
        return f"layer {i}'s feed-forward is not SwiGLU"
    for name, m in zip(_PROJECTIONS, layer_projections(layer)):
        w, why = _linear_weight(m, f"layer {i}'s {name}", group)
        if why is not None:
            return why
        assert w is not None
        want = dtype if group is None else (torch.uint8 if group[1] >= GG_LAYOUT else torch.int8)
        if w.dtype != want or not w.is_contiguous() or w.device.type != "cpu":
            return f"layer {i}'s {name} weight is {w.dtype}, strides {w.stride()} (needs contiguous {want})"
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


def why_not_model(model: Any, kv_approx: type | None = None, *, hooks: bool = True) -> str | None:
    """Why ``model`` (a TransformerLM) cannot take native decode steps here, or None when it can.

    Float weights (nn.Linear) of the model's dtype, or int8 ones (every projection an
    :class:`Int8GemvLinear` of one group size, fp32 activations, the input embedding any module with
    int8 rows ``weight_int8``). ``kv_approx``: the approximation every attention runs (the rounding of
    keys and values to int8, exact attention on what an int8 cache holds); then the steps need an int8
    cache (:func:`why_not_call`'s ``cache_kind``). ``hooks=False`` leaves out the forward hooks (which
    :func:`why_not_call` checks at every call: they come and go after the model's structure is fixed)."""
    reason = native.unavailable()
    if reason is not None:
        return f"the native kernels are unavailable: {reason}"
    layers = getattr(model, "layers", None)
    if getattr(model, "positions", None) != "rotary" or layers is None or len(layers) == 0:
        return "the model is not a TransformerLM with rotary positions"
    if getattr(model, "sliding_window", None) is not None:
        return "the model attends through a sliding window"
    first = getattr(getattr(layers[0], "self_attn", None), "qkv_proj", None)
    group = (first.group_size, first.kernel_tensors()[2]) if isinstance(first, Int8GemvLinear) else None
    if isinstance(first, GGUFLinear):  # GGUF's blocks: every projection a GGUFLinear, of any block kind
        group = (gguf_blocks.BLOCK, gguf_layout(first))
    emb = getattr(model, "embed", None)
    if getattr(model, "pos_embed", None) is not None:
        return "the model adds position embeddings"
    if group is not None and group[1] >= GG_LAYOUT:
        if not isinstance(emb, (nn.Embedding, GGUFEmbedding)):
            return f"the input embedding is a {type(emb).__name__}, not an nn.Embedding or a GGUFEmbedding"
    elif group is not None:
        if getattr(getattr(emb, "weight_int8", None), "dtype", None) != torch.int8:
            return "the int8 model's input embedding holds no int8 rows (weight_int8)"
    elif type(emb) is not nn.Embedding:
        return "the input embedding is not a plain nn.Embedding"
    elif emb.weight.stride(1) != 1:
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
    if group is not None and dtype != torch.float32:
        return f"int8 and GGUF-block weights take native steps with fp32 activations, the model's are {dtype}"
    if group is None and emb is not None and emb.weight.dtype != dtype:
        return f"the embedding is {emb.weight.dtype}, the final norm {dtype}"
    for i, layer in enumerate(layers):
        reason = _layer_reason(i, layer, dtype, final.eps, group, kv_approx)
        if reason is not None:
            return reason
    return _hooks_reason(model) if hooks else None


def why_not_call(
    model: Any,
    ids: Tensor,
    attention_mask: Tensor | None,
    cache: list[KVCache] | None,
    cache_kind: str = "dense",
) -> str | None:
    """Why this call of ``model.hidden_states`` is not a native decode step, or None when it is. Native
    calls take one token of each of up to ``ROWS_INT8`` rows (int8 weights) or ``ROWS_FLOAT`` rows (float
    weights) at one position, or a prompt of one row (int8: up to ``PROMPT_INT8`` tokens; float: up to
    ``ROWS_FLOAT``) without padding.
    Cheap: made on every call (the model's structure is :func:`why_not_model`'s, asked once; its
    forward hooks are scanned again only after a hook was registered anywhere). ``cache_kind``: the kind
    of cache the steps need, "dense" or "int8" (the model's attention rounds keys and values to int8)."""
    if cache is None or ids.dim() != 2:
        return "not a cached call"
    B, N = ids.shape
    if B > 1 and N > 1:
        return f"{N} tokens of each of {B} rows (native steps take one token of several rows, or one row)"
    if B * N > ROWS_FLOAT:
        int8 = isinstance(layer_projections(model.layers[0])[0], (Int8GemvLinear, GGUFLinear))  # 64 at once
        cap = ROWS_INT8 if int8 else ROWS_FLOAT
        if B > cap:
            return f"a batch of {B} rows (native steps take up to {cap} rows of this model's weights)"
        if N > ROWS_FLOAT and not int8:
            return (
                f"{N} tokens (native steps of float weights take up to {ROWS_FLOAT}; "
                "torch's matrix products are faster for more)"
            )
        if N > PROMPT_INT8:
            return (
                f"{N} tokens (native int8 prompts take up to {PROMPT_INT8}; "
                "the eager attention is faster for more)"
            )
    if model.__dict__.get("_native_hooks_stamp") != RemovableHandle.next_id:  # a hook was registered
        hooked = _hooks_reason_cached(model)
        if hooked is not None:
            return hooked
    if torch.is_grad_enabled() and any(p.requires_grad for p in model.final_norm.parameters()):
        return "gradients are on"
    if native.watched():
        return "a torch dispatch mode is on (a FLOP counter, fake tensors): it sees the eager step's ops"
    if attention_mask is not None and not bool(attention_mask.all()):
        return "the attention mask has padding"
    c = cache[0]
    checked = model.__dict__.get("_native_caches", ())  # weak references to the caches checked last
    if len(checked) != len(cache) or any(r() is not kv for r, kv in zip(checked, cache)):
        reason = _cache_reason(model, cache, cache_kind)
        if reason is not None:
            return reason
        model.__dict__["_native_caches"] = tuple(weakref.ref(kv) for kv in cache)
    if cache[-1].position != c.position:
        return "the layers' caches hold different numbers of positions"
    if c.position + N > c.max_len:
        return f"the cache is full ({c.max_len} positions)"
    if c.k.shape[0] != B:
        return f"the cache holds {c.k.shape[0]} rows for a call of {B}"
    in_range = 0 <= int(ids.min()) and int(ids.max()) < model.vocab_size
    if ids.dtype not in (torch.int64, torch.int32) or not in_range:
        return "a token id is not an integer in [0, vocab_size) (the eager step says why)"
    return None


def _cache_reason(model: Any, cache: list[KVCache], kind: str) -> str | None:
    """Why these caches cannot take native steps (their kind, dtype, device and layout; fixed when a
    cache is built, so asked once per list of caches), or None."""
    if len(cache) != len(model.layers):
        return f"{len(cache)} caches for {len(model.layers)} layers"
    dtype = model.final_norm.weight.dtype
    for kv in cache:
        if kv.kind != kind or kv.dtype != dtype or kv.k.device.type != "cpu":
            return f"the cache is {kv.kind} {kv.dtype}; native steps need a {kind} {dtype} cache on the CPU"
        scales = [t for t in (kv.k_scale, kv.v_scale) if t is not None]
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in scales):
            return "the int8 cache's scales are not contiguous fp32"
        if kv.position != cache[0].position:
            return "the layers' caches hold different numbers of positions"
        if not (kv.k.is_contiguous() and kv.v.is_contiguous()) or kv.k.shape[-1] != kv.v.shape[-1]:
            return "the cache storage is not contiguous (B, Hkv, max_len, D)"
    return None
