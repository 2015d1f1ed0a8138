"""The attention function multihead registers with ``transformers.AttentionInterface``.

transformers calls ``fn(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)``
with query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D) (GQA kept: no repeated heads) and expects
``(out (B, Sq, Hq, Dv) contiguous, weights or None)``. Model-specific extras arrive as keyword arguments:
``softcap`` (Gemma 2: scores ``s -> c * tanh(s / c)`` before the mask), ``s_aux`` (gpt-oss learned
attention sinks, one logit per head), ``sliding_window`` (already part of the mask), ``output_attentions``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..backends.decode import unmasked_step
from ..core.biases import softcap as softcap_bias
from ..core.functional import AttentionOutput, attention
from ..core.masks import Mask, causal
from .masks import HFMask

__all__ = ["make_attention_function"]


def _mask_and_bias(
    attention_mask: Any, query: Tensor, key: Tensor, value: Tensor, module: Any, is_causal: bool | None
) -> tuple[Tensor, Tensor, Mask | Tensor | None, Tensor | None]:
    """Read whatever transformers passed as ``attention_mask`` into (key, value, mask, additive bias)."""
    if isinstance(attention_mask, HFMask):
        key, value, mask = attention_mask.apply(key, value)
        return key, value, mask, None
    if attention_mask is None:
        # No mask was built (a custom 4-D mask path, or a model that relies on is_causal): follow
        # torch SDPA's is_causal as transformers' "sdpa" uses it (top-left: keys past Sq dropped).
        flag = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        nq = query.shape[2]
        if flag and nq > 1:
            if key.shape[2] > nq:
                key, value = key[:, :, :nq], value[:, :, :nq]  # (B, Hkv, Sq, D)
            return key, value, causal(), None
        return key, value, None, None
    if isinstance(attention_mask, Tensor):
        m = attention_mask[..., : key.shape[2]]  # (B, 1, Sq, Sk) eager masks can be longer than the keys
        if m.dtype == torch.bool:
            return key, value, m, None
        return key, value, None, m.to(query.dtype)  # additive (0 / finfo.min) float mask
    raise ValueError(
        f"attention_mask must be a multihead HFMask, a bool/float tensor or None, got "
        f"{type(attention_mask).__name__}; build the model with attn_implementation set to the name "
        "given to multihead.hf.register so that transformers builds the mask with multihead's mask function"
    )


def _decode_step(
    attention_mask: Any, query: Tensor, key: Tensor, value: Tensor, scaling: float | None
) -> Tensor | None:
    """out (B, Hq, 1, Dv) of a one-row step whose mask lets it see every key; None when the mask restricts
    the keys or the decode kernel cannot take the call (the general path then runs)."""
    if isinstance(attention_mask, HFMask):
        if attention_mask.mask is not None or key.shape[2] != attention_mask.kv_length:
            return None
        keep = attention_mask.keep
        if keep < key.shape[2]:  # a static cache's unused slots
            key, value = key[:, :, :keep], value[:, :, :keep]  # (B, Hkv, keep, D)
    elif attention_mask is not None:
        return None  # a tensor mask: the general path reads it
    return unmasked_step(query, key, value, scaling)


def make_attention_function(backend: Any = "auto") -> Callable[..., tuple[Tensor, Tensor | None]]:
    """Build the transformers attention function that runs ``mh.attention`` with ``backend``.

    Args:
        backend: a backend name (``"auto"``, ``"tiled"``, ...) or an approximation object from
            :mod:`multihead.approx`, passed to :func:`multihead.attention` unchanged.

    Returns:
        ``fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
        **kwargs) -> (out (B, Sq, Hq, Dv), weights (B, Hq, Sq, Sk) or None)``; ``fn.calls`` counts its calls
        made outside ``torch.compile`` (transformers compiles static-cache generation on a GPU).
    """

    def multihead_attention_forward(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        if not torch.compiler.is_compiling():  # a traced attribute write would break the graph and,
            wrapper.calls += 1  # type: ignore[attr-defined]  # guarded as a constant, recompile every call
        if (
            fast
            and query.shape[2] == 1
            and not dropout
            and kwargs.get("softcap") is None
            and kwargs.get("s_aux") is None
            and not kwargs.get("output_attentions")
        ):
            out = _decode_step(attention_mask, query, key, value, scaling)
            if out is not None:
                return out.transpose(1, 2).contiguous(), None  # (B, 1, Hq, Dv): a view, no copy
        key, value, mask, float_mask = _mask_and_bias(attention_mask, query, key, value, module, is_causal)
        cap = kwargs.get("softcap")
        bias: Any = softcap_bias(float(cap)) if cap is not None else None
        if float_mask is not None:
            if bias is not None:  # the cap acts before the additive mask: fold both into one tensor
                raise ValueError(
                    "softcap together with a float attention_mask tensor is not supported; build the model "
                    "with the multihead attn_implementation so the mask is a predicate"
                )
            bias = float_mask
        sinks = kwargs.get("s_aux")
        want_weights = bool(kwargs.get("output_attentions", False))
        chosen = backend
        if want_weights and not isinstance(backend, str):
            warnings.warn(
                "output_attentions=True: the approximation returns no weights; computing exact attention "
                "with the 'matrix' backend for this call",
                stacklevel=2,
            )
            chosen = "matrix"
        elif want_weights and backend not in ("matrix", "reference"):
            warnings.warn(
                "output_attentions=True needs the full weight matrix: multihead falls back to its 'matrix' "
                "backend (O(N^2) memory) for this call",
                stacklevel=2,
            )
            chosen = "matrix"
        result = attention(
            query,
            key,
            value,
            mask=mask,
            bias=bias,
            scale=scaling,
            dropout_p=float(dropout or 0.0),
            sinks=sinks,
            backend=chosen,
            return_weights=want_weights,
        )
        if isinstance(result, AttentionOutput):
            out, weights = result.out, result.weights
        else:
            out, weights = result, None
        return out.transpose(1, 2).contiguous(), weights  # (B, Sq, Hq, Dv)

    # A decode step that sees every key (one query row, no mask left, nothing else to apply) goes straight
    # to the decode backend's kernel call: the answer "auto" would give, without the per-call Problem
    # and backend choice (a third of a small decode step's attention time).
    fast = isinstance(backend, str) and backend in ("auto", "decode")
    wrapper = multihead_attention_forward
    wrapper.calls = 0  # type: ignore[attr-defined]
    return wrapper
