"""The functional core: ``attention`` (one entry, many backends) and ``explain`` (why auto chose).

Layout (PyTorch SDPA order): q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) -> (B, Hq, Nq, Dv).
"""

from __future__ import annotations

from torch import Tensor

from ..backends import registry
from ..backends.auto import explain, first_fit
from ..backends.registry import Backend
from .biases import Bias
from .dead_keys import clear_dead_keys
from .masks import Mask
from .problem import AttentionOutput, make_problem

__all__ = ["AttentionOutput", "attention", "backends", "explain"]


def backends() -> list[str]:
    """Names of the registered backends (``"auto"`` is a policy, not a backend)."""
    return registry.names()


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Bias | Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str | Backend = "auto",
    return_weights: bool = False,
    return_lse: bool = False,
    sinks: Tensor | None = None,
) -> Tensor | AttentionOutput:
    """Multi-head scaled dot-product attention, ``softmax(mask(q k^T * scale + bias)) v`` (eq. (2)).

    With ``sinks`` (learned attention sinks, OpenAI 2025, gpt-oss model card; why models need somewhere
    to put attention: Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks"),
    head h's logit ``sink_h`` joins every row's softmax denominator as one more column whose value is 0.
    For the row scores ``s_j`` after scale, bias and mask::

        p_j = exp(s_j) / (exp(sink_h) + sum_j exp(s_j)),     out = sum_j p_j v_j

    The sink takes probability mass but adds nothing to the output, so a head can attend "nowhere".

    Args:
        q: (B, Hq, Nq, D) queries.
        k: (B, Hkv, Nk, D) keys; ``Hq % Hkv == 0`` and query head i reads kv head ``i // (Hq // Hkv)``.
        v: (B, Hkv, Nk, Dv) values.
        mask: a :class:`Mask` (``mh.causal()``, ...) or a bool tensor broadcastable to (B, Hq, Nq, Nk);
            True = may attend. Causal alignment is bottom-right.
        bias: a :class:`Bias` (``mh.alibi(Hq)``, ``mh.softcap(c)``, ...) or a float tensor broadcastable
            to (B, Hq, Nq, Nk), added to the scaled scores.
        scale: score scale, default ``1/sqrt(D)``.
        dropout_p: dropout on the attention weights, in [0, 1). Applied whenever it is > 0 (the modules
            pass 0 in eval mode).
        backend: ``"auto"``, one of :func:`backends`, or a backend object: an approximation from
            :mod:`multihead.approx` (``TopK(k)``, ``Nystrom(m)``, ...) computed instead of exact attention
            (it returns the output only: no weights, no lse), or any object with ``name``, ``summary``,
            ``why_not(problem)`` and ``run(problem)``.
        return_weights: also return the (B, Hq, Nq, Nk) weights (``matrix`` / ``reference`` only).
        return_lse: also return the (B, Hq, Nq) log-sum-exp of the scores (fp32; float64 for float64);
            with ``sinks`` it includes the sink: ``logaddexp(lse_scores, sink_h)``.
        sinks: None, or a floating (Hq,) tensor on q's device: one learned logit per query head (see
            above), differentiable. ``-inf`` for a head is the same as no sink. Every exact backend except
            ``sdpa`` (which has no sink term) takes it; ``auto`` picks one that does.

    Returns:
        out (B, Hq, Nq, Dv) in the input dtype, or ``AttentionOutput(out, weights, lse)`` when
        ``return_weights`` or ``return_lse`` is set. Keys that the mask hides from every query of their
        (batch, head) never influence the output or the gradients, whatever they hold (NaN and Inf
        included), however the mask is written: ``key_padding(real)``, ``~key_padding(pad)``,
        ``~~padding(lengths)``, a bool tensor, any ``&`` / ``|`` / ``~`` of masks. A row with no
        allowed key gives zeros (lse = -inf); with a sink it also gives zeros (the sink takes all the
        mass) and lse = sink_h.
        With sinks the weights are the ``p_j`` above, so a row sums to ``1 - p_sink`` < 1.

    Raises:
        ValueError: bad shapes, dtypes, head counts, masks/biases that do not broadcast, a ``backend``
            that is neither "auto", a registered name nor a backend object, a backend that cannot serve
            the request (an approximation asked for weights or lse, or given a mask or bias it cannot
            apply, or given sinks), ``dropout_p`` outside [0, 1), ``sinks`` that is not a floating (Hq,)
            tensor on q's device, sinks forced onto ``backend="sdpa"``, a dense (B, Hq, Nq, Nk) score
            matrix (``matrix``, ``reference``, ``return_weights``) or a dense attn_mask (``sdpa`` with a
            mask or bias) over ``MULTIHEAD_MAX_SCORE_BYTES`` (default 4 GiB) or the free memory
            (``auto`` then takes ``tiled``), a ``custom`` mask or ``custom_bias`` whose function returns
            a shape that does not broadcast to its index tensors.
    """
    chosen = registry.resolve(backend)
    p = make_problem(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=scale,
        dropout_p=dropout_p,
        return_weights=return_weights,
        return_lse=return_lse,
        sinks=sinks,
    )
    p = clear_dead_keys(p)  # garbage in keys no query may see must not reach any kernel (NaN * 0)
    res = (registry.get(first_fit(p)) if chosen is None else chosen).run(p)
    if return_weights or return_lse:
        return res
    return res.out
