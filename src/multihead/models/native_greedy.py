"""Greedy runs of a :class:`~multihead.TransformerLM` in one native call (``decode_greedy.c``): up to 8
tokens a call, each the output head's product, its argmax (the first maximum, as
:func:`~multihead.models.generation.pick_next`), the next token's embedding row and a native decode step
(:mod:`.native_step`), in a loop: the generation loop's fast path for batch-1 greedy decoding, without the
interpreter between the tokens.

Shape legend: d model width, V vocabulary.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor, nn

from .. import native
from ..native import gguf_blocks
from ..native import int8 as native_int8
from ..nn.kv_cache import KVCache
from .gemv_linear import GemvLinear
from .gguf_linear import GGUFEmbedding, GGUFLinear
from .int8_gemv_linear import Int8GemvLinear
from .native_fits import GG_LAYOUT
from .native_step import kernel_tensors_of, plan_for, rotary_rows

__all__ = ["greedy_steps", "why_not_greedy"]


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
    plan = plan_for(model, cache, lib)
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
        head.kernel_tensors() if int8 else kernel_tensors_of(head)
    )  # (V, d), packed or blocks (V, R)
    g.head, g.vocab = w.data_ptr(), w.shape[0]
    g.head_scale = None if scale is None else scale.data_ptr()
    g.head_group = (head.group_size or d) if int8 else 0
    g.head_blocked = how
    g.head_bias = None if head.bias is None else head.bias.data_ptr()
    tables = rotary_rows(plan, pos, max(run, 1))  # 2 x (run, D/2) per distinct table
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
