"""Attention maps of a real model: what each head of each layer attends to, per input.

:func:`capture_attention` makes every self-attention of a model also return its weights while the
context is open, without a second copy of the attention math: a forward pre-hook marks which layer is
running, and the module's call of :func:`multihead.attention` is served with ``return_weights=True``
(the ``matrix`` path, or ``reference`` where the module asked for it). Nothing is stored on the modules.

    with capture_attention(model) as records:
        model(ids)
    records[l]  # the (B, Hq, Nq, Nk) weights of each call of layer l's self-attention, in call order

:func:`attention_maps` runs one input at a time and returns (L, H, N, N) per input.

Shape legend: L layers, H (= Hq) heads, B batch, N tokens, Nq / Nk query / key tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ..core import functional
from ..nn import attention as attention_module
from ..nn.attention import MultiHeadAttention
from .access import forward_ids, layers_of, model_device, to_id_lists

__all__ = ["attention_maps", "capture_attention"]

# .sinks: (module, record list) of the self-attention running in this thread, one per open capture
_local = threading.local()
_lock = threading.Lock()
_installed = 0  # open capture contexts; the recording `attention` is installed while > 0
_original: Any = functional.attention  # what attention_module called before the first capture


def _sinks() -> list[tuple[nn.Module, list[Tensor]]]:
    if not hasattr(_local, "sinks"):
        _local.sinks = []
    return _local.sinks


def _recording_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Any:
    """``multihead.attention`` that, inside a captured layer, also computes and records the weights."""
    sinks = _sinks()
    if not sinks:
        return _original(q, k, v, **kwargs)
    wanted = bool(kwargs.pop("return_weights", False)) or bool(kwargs.get("return_lse", False))
    if kwargs.get("backend", "auto") not in ("matrix", "reference"):
        kwargs["backend"] = "auto"  # auto serves return_weights with `matrix`
    res = _original(q, k, v, return_weights=True, **kwargs)
    assert not isinstance(res, Tensor) and res.weights is not None
    for _, sink in sinks:  # every open capture of this module
        sink.append(res.weights.detach())  # (B, Hq, Nq, Nk)
    return res if wanted else res.out


def _install() -> None:
    global _installed, _original
    with _lock:
        if _installed == 0:
            _original = attention_module.attention
            attention_module.attention = _recording_attention
        _installed += 1


def _uninstall() -> None:
    global _installed
    with _lock:
        _installed -= 1
        if _installed == 0:
            attention_module.attention = _original


@contextmanager
def capture_attention(model: nn.Module, *, designs: bool = False) -> Iterator[list[list[Tensor]]]:
    """Record the attention weights of every layer's self-attention while the context is open.

    Yields ``records``: ``records[l]`` collects the (B, Hq, Nq, Nk) weights of each call of layer l (in
    call order, detached). Layers whose heads were all pruned record nothing. The weights come from
    ``mh.attention(..., return_weights=True)`` inside the module's own forward, so they are exactly what
    the layer used (up to the float rounding of the ``matrix`` backend that computes them).

    While the context is open, every call of the model's self-attentions is recorded (the hooks sit on
    the modules, whichever thread calls them); the module-level ``attention`` of
    ``multihead.nn.attention`` is swapped for one that records only inside those calls and passes
    every other call through unchanged.

    Args:
        model: a model with TransformerLayers.
        designs: also record the head designs of :mod:`multihead.variants` (every MultiHeadAttention
            subclass, not only those whose heads are the textbook eq. (4)): each ``mh.attention`` call
            their template step ``attend`` makes is recorded, which for a design that mixes or gates the
            heads after the softmax is the map before that mixing. Designs that call attention
            elsewhere (differential attention's two maps) record nothing.

    Raises:
        ValueError: the model has no TransformerLayer.
    """
    layers = layers_of(model)
    records: list[list[Tensor]] = [[] for _ in layers]
    handles = []
    for sink, layer in zip(records, layers):
        attn = layer.self_attn
        if isinstance(attn, MultiHeadAttention) and (attn.textbook or designs):

            def push(m: nn.Module, _args: Any, sink: list[Tensor] = sink) -> None:
                sinks = _sinks()
                # self-attentions never nest: entries of another module are left by a forward that raised
                sinks[:] = [e for e in sinks if e[0] is m]
                sinks.append((m, sink))

            def pop(m: nn.Module, _args: Any, _out: Any) -> None:
                _sinks().clear()

            handles += [attn.register_forward_pre_hook(push), attn.register_forward_hook(pop)]
    _install()
    try:
        yield records
    finally:
        _uninstall()
        _sinks().clear()  # a forward that raised skipped its pop hook
        for h in handles:
            h.remove()


@torch.no_grad()
def attention_maps(model: nn.Module, texts_or_ids: Any) -> list[Tensor]:
    """Attention weights of every head of every layer, one input at a time.

    Args:
        model: a SentenceEncoder (texts or ids), a Bert or a TransformerLM (ids).
        texts_or_ids: a list of texts, a list of id lists / 1-D id tensors, or an int tensor (n, N).

    Returns:
        one float tensor (L, H, N_i, N_i) per input i (N_i its token count, [CLS] and [SEP] included
        for BERT), on the model's device. Row q of head (l, h) is the distribution of query token q over
        the keys (causal models put zeros right of the diagonal).

    Raises:
        ValueError: inputs the model cannot take, or layers with different head counts (after
            :func:`~multihead.heads.prune`; use :func:`capture_attention` for those).
    """
    seqs = to_id_lists(model, texts_or_ids)
    device = model_device(model)
    maps = []
    for seq in seqs:
        with capture_attention(model) as records:
            forward_ids(model, torch.as_tensor([seq], device=device))  # (1, N)
        counts = {len(r) and r[0].shape[1] for r in records}
        if len(counts) != 1 or 0 in counts:
            raise ValueError(
                f"the layers have head counts {[r[0].shape[1] if r else 0 for r in records]}; maps stack "
                "only when every layer has the same number of heads: use capture_attention for pruned models"
            )
        maps.append(torch.stack([r[0][0] for r in records]))  # (L, H, N, N)
    return maps
