"""A decode step of a LLaMA-style :class:`~multihead.TransformerLM` in one native call for all its layers.

A batch-1 decode step of a small model spends a large share of its time outside the matrix-vector
products: about 60 small tensor ops per layer (norms, rotary, the cache write, attention, residuals,
SwiGLU), each a few microseconds, and more once the weights streaming through the caches have evicted
the interpreter's working set (measured: a tiny op costs 27 us right after the weights of a layer went
by, 4.7 us warm). :func:`decode_step` runs every layer in one call of ``mh_decode_layers``
(``multihead/native/decode_layer.c``): the same equations, the native GEMV for the products, the same
bf16 rounding points as the eager modules, and the model's own dense :class:`~multihead.KVCache`
storage (it writes position p in place and advances the cache), so eager and native steps can follow
each other in one generation. The final norm runs in the same call; the output head stays in torch,
except in a greedy run: :func:`greedy_steps` picks up to 8 greedy tokens in one native call
(``decode_greedy.c``: the head's GEMV, the argmax, the next token's embedding row and the layers, in a
loop), the generation loop's fast path for batch-1 greedy decoding (on the llama-155m shape, one thread,
a Zen 5 core: 0.4-0.7 ms less a token, 6-11% of an int8 step).

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
from ..native import gguf_blocks, hugepages
from ..native import int8 as native_int8
from ..nn.attention import MultiHeadAttention
from ..nn.feed_forward import FeedForward
from ..nn.kv_cache import KVCache
from ..nn.layers import TransformerLayer
from ..nn.norms import RMSNorm
from ..nn.positions import RotaryEmbedding
from .gemv_linear import GemvLinear
from .gguf_linear import GGUFEmbedding, GGUFLinear
from .int8_gemv_linear import Int8GemvLinear

__all__ = ["decode_step", "greedy_steps", "huge_pages", "why_not_call", "why_not_greedy", "why_not_model"]


_PROJECTIONS = ("qkv_proj", "o_proj", "w1", "w3", "w2")  # the order of the native layer's weights

#: the most rows of one native call: with int8 weights as many as the multi-row product rounds and holds
#: at once (a longer prompt runs in chunks of as many tokens); with float weights (each block of rows met
#: by every row in turn) as many as measured faster than the eager layers (llama-155m, one thread: a
#: batch's step of 8 rows fp32 81 against 92 ms, bf16 33 against 65; 16 rows 115 against 121 and 59
#: against 71), and a float prompt longer than that runs the eager layers; an int8 prompt runs natively
#: up to ``PROMPT_INT8`` tokens (past that the native attention, one row at a time, costs more than the
#: eager layers save: 1024 tokens 1.03x their time with one thread, 1.05x with two; 512 tokens 0.96x, 0.99x)
ROWS_INT8, ROWS_FLOAT, PROMPT_INT8 = 64, 16, 512


def _projections(layer: Any) -> list[Any]:
    attn, ffn = layer.self_attn, layer.ffn
    return [attn.qkv_proj, attn.o_proj, ffn.w1, ffn.w3, ffn.w2]


#: the layout number of GGUF-block weights of ggml type T in a native layer: GG_LAYOUT + T (native.h)
GG_LAYOUT = 16


def _gguf_layout(m: GGUFLinear) -> int:
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
    if isinstance(m, GGUFLinear):
        if m.bias is not None or _gguf_layout(m) != group[1]:
            return None, f"{name} has a bias or {m.kind} blocks where another projection has other blocks"
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
    for name, m in zip(_PROJECTIONS, _projections(layer)):
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
    if isinstance(first, GGUFLinear):  # GGUF's blocks: one kind for every projection of the model
        group = (gguf_blocks.BLOCK, _gguf_layout(first))
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
        int8 = isinstance(_projections(model.layers[0])[0], (Int8GemvLinear, GGUFLinear))  # 64 at once
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


def huge_pages(model: Any) -> int:
    """Back the float weights a decode step streams (every layer's projections and the head) with 2 MiB pages
    in place (:func:`multihead.native.hugepages.collapse`; a decode step reads them at up to 1.6x the
    rate where the TLB would otherwise miss every 4 KiB), each storage once per model. Returns the bytes
    collapsed by this call."""
    done: set[int] = model.__dict__.setdefault("_native_hugepages", set())
    # float projections; int8 and GGUF-block ones were moved to 2 MiB pages by their quantizer or loader
    weights = [m.weight for layer in model.layers for m in _projections(layer) if isinstance(m, nn.Linear)]
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        weights.append(model.lm_head.weight)
    fresh = [w for w in weights if w.untyped_storage().data_ptr() not in done]
    done.update(w.untyped_storage().data_ptr() for w in fresh)
    return hugepages.collapse(fresh)


class _Plan:
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
            projections = _projections(layer)
            int8 = [isinstance(m, (Int8GemvLinear, GGUFLinear)) for m in projections]
            kernel = [_kernel_tensors(m) for m in projections]
            ws, scales = [k[0] for k in kernel], [k[1] for k in kernel if k[1] is not None]
            self.weights += [*norms, *ws, *scales]
            a.g_attn, a.g_ffn = (t.data_ptr() for t in norms)
            a.w[:] = [t.data_ptr() for t in ws]
            a.s[:] = [None if k[1] is None else k[1].data_ptr() for k in kernel]  # packed: the rows again
            a.group = getattr(projections[0], "group_size", None) or 1 << 62  # per row: G >= any width
            layouts = {k[2] for k, q in zip(kernel, int8) if q}
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


def _kernel_tensors(m: Any) -> tuple[Tensor, Tensor | None, int]:
    """What a native layer reads of a projection: (weight, int8 scales or None, layout); GGUF blocks are
    their own scales (a non-NULL pointer) in layout GG_LAYOUT + their type."""
    if isinstance(m, GGUFLinear):
        return m.blocks, m.blocks, _gguf_layout(m)
    return m.kernel_tensors() if isinstance(m, Int8GemvLinear) else (m.weight, None, 0)


def _plan(model: Any, cache: list[KVCache], lib: ctypes.CDLL) -> _Plan:
    plan = model.__dict__.get("_native_plan")
    if plan is None or not plan.fits(cache):
        plan = model.__dict__["_native_plan"] = _Plan(model, cache, lib)
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
    plan = _plan(model, cache, lib)
    pos = int(cache[0].position)
    x = _embedding(model, ids, plan.dtype)  # (R, d) the residual stream, updated in place
    xp, (R, d) = x.data_ptr(), x.shape
    tables = _rotary_rows(plan, pos, R if seq else 1)  # rows of kept tables: their addresses stay valid
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


#: a token id (1, 1) to ask whether a decode step would run natively (a greedy run picks ids in range)
ONE_ID = torch.zeros(1, 1, dtype=torch.long)


def _head_reason(head: Any, dtype: torch.dtype) -> str | None:
    """Why the output head's product cannot run inside a native greedy run, or None."""
    if type(head) is GGUFLinear:  # its blocks (uint8 rows), fp32 activations and logits
        if head._forward_hooks or head._forward_pre_hooks or head.why_not_native is not None:
            return "the output head has forward hooks or no native kernel"
        b = head.bias
        if not head.blocks.is_contiguous() or (b is not None and not b.is_contiguous()):
            return "the output head's blocks or bias are not contiguous"
        return None
    if type(head) not in (GemvLinear, Int8GemvLinear):
        return f"the output head is a {type(head).__name__}, not a GemvLinear or an Int8GemvLinear"
    if head._forward_hooks or head._forward_pre_hooks:
        return "the output head has forward hooks (the native run would skip them)"
    if head.why_not_native is not None:
        return f"the output head's kernel: {head.why_not_native}"
    int8 = type(head) is Int8GemvLinear  # fp32 activations (why_not_model), fp32 logits
    w, scale, _ = head.kernel_tensors() if int8 else (head.weight, None, 0)
    want, out = (torch.int8, torch.float32) if int8 else (dtype, dtype)
    if w.dtype != want or not w.is_contiguous() or w.device.type != "cpu":
        return f"the output head's weight is {w.dtype}, strides {w.stride()} (needs contiguous {want})"
    if scale is not None and scale is not w and (scale.dtype != torch.float32 or not scale.is_contiguous()):
        return "the int8 output head's scales are not contiguous fp32"
    if int8 and head.blocked and not native_int8.reads_blocked():
        return "the int8 output head's rows are blocked and this build's kernel reads them in order"
    b = head.bias
    if b is not None and (b.dtype != out or not b.is_contiguous() or b.device.type != "cpu"):
        return f"the output head's bias is {b.dtype} (needs contiguous {out})"
    return None


def _table(model: Any, dtype: torch.dtype) -> tuple[Tensor, Tensor | None, int, int] | None:
    """The input embedding as the native run reads it: (rows, int8 scales or None, group, layout: int8
    blocked or not, or GG_LAYOUT + a GGUF block type)."""
    emb = model.embed
    if type(emb) is nn.Embedding:
        return emb.weight, None, 0, False  # why_not_model: contiguous rows of the model's dtype
    if type(emb) is GGUFEmbedding and emb.blocks.is_contiguous() and dtype == torch.float32:
        return emb.blocks, None, 0, GG_LAYOUT + gguf_blocks.KINDS[emb.kind][0]
    native_table = getattr(emb, "native_table", None)
    return None if native_table is None else native_table()


def why_not_greedy(model: Any) -> str | None:
    """Why :func:`greedy_steps` cannot pick ``model``'s greedy tokens where its decode steps run natively
    (the caller asked that first): its output head or its input embedding, or None."""
    dtype = model.final_norm.weight.dtype
    reason = _head_reason(model.lm_head, dtype)
    if reason is not None:
        return reason
    if _table(model, dtype) is None:
        return "the input embedding's rows cannot be read natively"
    return None


def greedy_steps(
    model: Any, h: Tensor, out: Tensor, t: int, steps: int, last: bool, eos: int | None, cache: list[KVCache]
) -> tuple[int, Tensor]:
    """Pick up to ``steps`` greedy tokens in one native call (``decode_greedy.c``) and write them to
    ``out[0, t : t + picked]``: from the last position of ``h`` (1, n, d) the output head, the argmax (the
    first maximum, as :func:`~multihead.models.generation.pick_next`), then a native decode step on that
    token (every layer's cache written and advanced), and again; no step after ``eos`` or, when ``last``,
    after the last pick. Returns ``(picked, h)``, h (1, 1, d) the final-normed state after the last step.

    The caller checked :func:`why_not_greedy`. The same kernels as the step-by-step path (the head's
    GEMV of its kind, the decode layers), so the same tokens and caches.

    Raises:
        ValueError: the native library cannot allocate its memory.
    """
    lib = native.library()
    assert lib is not None
    plan = _plan(model, cache, lib)
    pos, n, d = int(cache[0].position), len(plan.rotaries), h.shape[-1]
    run = steps - 1 if last else steps  # decode steps the run may take
    if pos + run > cache[0].max_len:
        raise ValueError(f"the cache holds {cache[0].max_len} positions, the run needs {pos + run}")
    state = h[0, -1].contiguous().clone()  # (d,) the head's input, then the run's state
    head, table = model.lm_head, _table(model, plan.dtype)
    assert table is not None
    g = native.GreedyArgs()
    rows, scales, g.table_group, g.table_blocked = table
    g.table, g.table_row = rows.data_ptr(), rows.stride(0)
    g.table_scale = None if scales is None else scales.data_ptr()
    g.table_scale_row = 0 if scales is None else scales.stride(0)
    int8 = type(head) is Int8GemvLinear
    w, scale, how = (
        head.kernel_tensors() if int8 else _kernel_tensors(head)
    )  # (V, d), packed or blocks (V, R)
    g.head, g.vocab = w.data_ptr(), w.shape[0]
    g.head_scale = None if scale is None else scale.data_ptr()
    g.head_group = (head.group_size or d) if int8 else 0
    g.head_blocked = how
    g.head_bias = None if head.bias is None else head.bias.data_ptr()
    tables = _rotary_rows(plan, pos, max(run, 1))  # 2 x (run, D/2) per distinct table
    strides = {c.stride(0) for c, _ in tables.values()}
    if len(strides) != 1:
        raise ValueError(f"the layers' rotary tables have row strides {sorted(strides)}; need one")
    cos = (ctypes.c_void_p * n)(*(tables[id(r)][0].data_ptr() for r in plan.rotaries))
    sin = (ctypes.c_void_p * n)(*(tables[id(r)][1].data_ptr() for r in plan.rotaries))
    g.cos, g.sin = ctypes.addressof(cos), ctypes.addressof(sin)
    g.rot_stride = strides.pop()
    ids = torch.empty(steps, dtype=torch.int64)  # (steps,)
    picked, stepped, done = ctypes.c_int64(0), ctypes.c_int64(0), ctypes.c_int64(0)
    final = (plan.addresses[0], plan.eps)
    status = lib.mh_decode_greedy(
        plan.args,
        n,
        pos,
        ctypes.byref(g),
        *final,
        state.data_ptr(),
        steps,
        int(last),
        eos if eos is not None and 0 <= eos < g.vocab else -1,  # an id outside the vocabulary never comes
        ids.data_ptr(),
        ctypes.byref(picked),
        ctypes.byref(stepped),
        ctypes.byref(done),
    )
    for kv in cache:
        if stepped.value:
            kv.advance(stepped.value)
    for kv in cache[: done.value]:  # a step that failed part-way: the layers that wrote their caches
        kv.advance(1)
    out[0, t : t + picked.value] = ids[: picked.value]
    if status != 0:  # -2 cannot happen: why_not_model and why_not_greedy checked the layouts
        raise ValueError("the native greedy run could not allocate its memory")
    return picked.value, state.view(1, 1, d)


def _rotary_rows(plan: _Plan, pos: int, n: int) -> dict[int, tuple[Tensor, Tensor]]:
    """Each distinct rotary table's cos and sin rows ``pos .. pos + n - 1`` (fp32, 2 x (n, D/2)), keyed by
    the table owner's id (layers usually share one RotaryEmbedding)."""
    tables: dict[int, tuple[Tensor, Tensor]] = {}
    for rotary in plan.rotaries:
        if id(rotary) not in tables:
            tables[id(rotary)] = rotary._table(pos, n, torch.float32, torch.device("cpu"))
    return tables


def _embedding(model: Any, ids: Tensor, dtype: torch.dtype) -> Tensor:
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
