"""Head importance (Michel et al., 2019, "Are Sixteen Heads Really Better than One?", §4.1).

Every head h gets a gate xi_h multiplying its output before W^O (the ``head_mask`` of
:class:`MultiHeadAttention`). At xi = 1 the model is unchanged, and

    I_h = E_x | dL(x) / d xi_h |                (Michel et al., eq. 3; x a batch, as in their code)

is the first-order change of the loss if head h were removed. Scores are then normalised per layer by
their l2 norm (Michel et al. follow Molchanov et al., 2017), so heads compare across layers.

The gates are put in by forward pre-hooks on each layer's self-attention (:func:`gate_heads`), so any
model made of TransformerLayers takes them, whether or not its forward has a ``head_mask`` argument.

Shape legend: L layers, H heads per layer, B batch, N tokens, d width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.lm import TransformerLM
from ..nn.attention import MultiHeadAttention
from ..pretrained.bert import Bert
from ..pretrained.sentence_encoder import SentenceEncoder
from .access import layers_of, model_device, pad_batch

__all__ = ["CONTRASTIVE_SCALE", "gate_heads", "importance", "lm_loss", "span_contrastive_loss"]

#: Similarity scale of the in-batch contrastive loss: 20 = 1 / temperature 0.05, the scale of
#: sentence-transformers' MultipleNegativesRankingLoss that all-MiniLM-L6-v2 was trained with.
CONTRASTIVE_SCALE = 20.0
Loss = Callable[[nn.Module, Any], Tensor]


@contextmanager
def gate_heads(model: nn.Module, gates: Tensor | Sequence[Tensor]) -> Iterator[None]:
    """Multiply each layer's self-attention head outputs by ``gates[l]`` (Hq_l,) while the context is open.

    A ``head_mask`` the caller passes too is multiplied by the gate. Gradients flow to the gates.

    Raises:
        ValueError: a gate count that differs from the number of layers, a layer without heads.
    """
    layers = layers_of(model)
    if len(gates) != len(layers):
        raise ValueError(f"gates has {len(gates)} rows but the model has {len(layers)} layers")
    handles = []
    try:
        for i, (layer, gate) in enumerate(zip(layers, gates)):
            if not isinstance(layer.self_attn, MultiHeadAttention):
                raise ValueError(f"layer {i} has no heads left to gate (all were pruned)")

            def hook(_m: nn.Module, args: Any, kwargs: dict[str, Any], gate: Tensor = gate) -> Any:
                mask = kwargs.get("head_mask")
                kwargs["head_mask"] = gate if mask is None else mask * gate
                return args, kwargs

            handles.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def _halves(text: str) -> tuple[str, str] | None:
    words = text.split()
    if len(words) < 4:
        return None
    mid = len(words) // 2
    return " ".join(words[:mid]), " ".join(words[mid:])


def _embed(model: SentenceEncoder, texts: list[str]) -> Tensor:
    """Mean-pooled, L2-normalised embeddings (b, d), with gradients (unlike ``encode``)."""
    ids, real = pad_batch(model.tokenize(texts), model_device(model))  # (b, N) each
    hidden = model.bert(ids, attention_mask=real)  # (b, N, d)
    w = real.to(hidden.dtype).unsqueeze(-1)  # (b, N, 1)
    return F.normalize((hidden * w).sum(1) / w.sum(1), dim=-1)  # (b, d)


def span_contrastive_loss(model: SentenceEncoder, texts: Sequence[str]) -> Tensor:
    """The default self-supervised loss of a SentenceEncoder: match each text's two halves in a batch.

    Each text is cut at its middle word into a first and a second half; the loss is the symmetric
    in-batch cross-entropy of ``CONTRASTIVE_SCALE * cos(first_i, second_j)`` with targets i = j (the
    MultipleNegativesRankingLoss all-MiniLM-L6-v2 was trained with, on spans of one document as the
    positive pair, as in DeCLUTR). It needs no labels and no second model, and at xi = 1 its gradient is
    not zero. A fidelity loss against the unpruned model would be: it is minimal at xi = 1.

    Raises:
        ValueError: fewer than two texts with at least 4 words.
    """
    pairs = [p for p in (_halves(t) for t in texts) if p is not None]
    if len(pairs) < 2:
        raise ValueError(
            f"span_contrastive_loss needs >= 2 texts of >= 4 words per batch, got {len(pairs)}; "
            "pass longer texts or a larger batch_size"
        )
    a = _embed(model, [p[0] for p in pairs])  # (b, d)
    b = _embed(model, [p[1] for p in pairs])  # (b, d)
    logits = CONTRASTIVE_SCALE * a @ b.T  # (b, b)
    target = torch.arange(len(pairs), device=logits.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def lm_loss(model: TransformerLM, ids: Tensor) -> Tensor:
    """The default loss of a TransformerLM: next-token cross-entropy over ids (B, N)."""
    logits = model(ids)  # (B, N, V)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _default_loss(model: nn.Module) -> Loss:
    if isinstance(model, SentenceEncoder):
        return span_contrastive_loss  # type: ignore[return-value]
    if isinstance(model, TransformerLM):
        return lm_loss  # type: ignore[return-value]
    kind = "a Bert here has no pretraining head" if isinstance(model, Bert) else "no default loss"
    raise ValueError(
        f"{type(model).__name__}: {kind}; pass loss=fn(model, batch) -> scalar tensor "
        "(defaults exist for SentenceEncoder and TransformerLM)"
    )


def _batches(data: Any, batch_size: int) -> list[Any]:
    if isinstance(data, Tensor):
        return list(data.split(batch_size))  # (<= batch_size, ...) each
    items = list(data)
    return [items[i : i + batch_size] for i in range(0, len(items), batch_size)]


def importance(
    model: nn.Module, data: Any, loss: Loss | None = None, *, batch_size: int = 16, normalize: bool = True
) -> Tensor:
    """Michel et al.'s head importance ``I_h = E_batches |dL/d xi_h|`` at xi = 1, layer-normalised.

    Args:
        model: a multihead model; every layer must have the same head count H.
        data: examples, cut into batches of ``batch_size``: texts for a SentenceEncoder, an int tensor
            (n, N) of ids for a TransformerLM, anything ``loss`` understands otherwise.
        loss: ``loss(model, batch) -> scalar``. Default: :func:`span_contrastive_loss` for a
            SentenceEncoder, :func:`lm_loss` (next-token cross-entropy) for a TransformerLM.
        batch_size: examples per gradient (the expectation runs over batches, as in Michel et al.'s code).
        normalize: divide each layer's scores by their l2 norm (Michel et al.); False gives raw |grad|.

    Returns:
        (L, H) float tensor on the CPU, larger = more important. The model runs in eval mode (no
        dropout); its training flag and parameters are left as they were.

    Raises:
        ValueError: layers with different head counts, empty data, a bad batch_size, a model without a
            default loss and no ``loss``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    layers = layers_of(model)
    counts = [getattr(layer.self_attn, "n_heads", 0) for layer in layers]
    if len(set(counts)) != 1 or counts[0] == 0:
        raise ValueError(
            f"importance needs the same head count in every layer, got {counts}; score heads before "
            "pruning (mask them with head_mask to score what is left)"
        )
    loss_fn = _default_loss(model) if loss is None else loss
    batches = _batches(data, batch_size)
    if not batches:
        raise ValueError("data is empty; give at least one example")
    p = next(model.parameters())
    gates = torch.ones(len(layers), counts[0], dtype=p.dtype, device=p.device, requires_grad=True)  # (L, H)
    total = torch.zeros(len(layers), counts[0], dtype=torch.float64)  # (L, H)
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad(), gate_heads(model, gates):
            for batch in batches:
                (grad,) = torch.autograd.grad(loss_fn(model, batch), gates)  # (L, H)
                total += grad.detach().abs().double().cpu()
    finally:
        model.train(was_training)
    scores = total / len(batches)
    if normalize:
        scores = scores / scores.norm(dim=1, keepdim=True).clamp(min=1e-20)  # l2 per layer
    return scores.float()
