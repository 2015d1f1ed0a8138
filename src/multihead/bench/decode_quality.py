"""How far a quantised model's decode steps are from the fp32 model's, for ``multihead bench decode``'s
int8 native rows: the logit error along the reference's greedy tokens, and where the greedy tokens part.

Shape legend: N tokens of the sequence, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["int8_quality", "step_logits"]


def step_logits(model: Any, seq: Tensor, n_prompt: int) -> Tensor:
    """Logits (n, V) that predict tokens n_prompt .. N-1 of ``seq`` (1, N): the prompt's prefill, then one
    decode step per token (the decode path: native steps, int8 activations and cache where the model has
    them)."""
    cache = model.make_cache(1, seq.shape[1])
    out = [model(seq[:, :n_prompt], cache=cache)[0, -1]]  # (V,)
    out += [model(seq[:, t : t + 1], cache=cache)[0, -1] for t in range(n_prompt, seq.shape[1] - 1)]
    return torch.stack(out).float()  # (n, V)


def int8_quality(reference: nn.Module, models: dict[str, nn.Module], seq: Tensor, n_prompt: int) -> dict:
    """How far each model's decode steps are from ``reference``'s (the fp32 model) along ``seq`` (1, N):
    the reference's greedy tokens after ``n_prompt`` prompt tokens, fed to every model one step at a time.

    Returns:
        ``{name: {"logit_error", "first_difference", "margin"}}``: the largest logit error as a fraction of
        the reference logits' range (tests/test_quant.py's measure); the first step whose greedy token
        differs from the reference's (None: none does) and the reference's margin there (its best logit
        minus the model's choice).
    """
    with torch.inference_mode():
        ref = step_logits(reference, seq, n_prompt)  # (n, V)
        span = float(ref.max() - ref.min())
        out = {}
        for name, m in models.items():
            got = step_logits(m, seq, n_prompt)  # (n, V)
            differ = (got.argmax(-1) != ref.argmax(-1)).nonzero()
            first = int(differ[0, 0]) if len(differ) else None
            margin = None
            if first is not None:
                row = ref[first]
                margin = float(row.max() - row[got[first].argmax()])
            out[name] = {
                "logit_error": float((got - ref).abs().max()) / span,
                "first_difference": first,
                "margin": margin,
            }
        return out
