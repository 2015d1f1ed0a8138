"""Where two greedy generations part, and by how much the reference model preferred one token there.

Two implementations of the same model in reduced precision (bf16, fp16) may pick different greedy
tokens where the two best logits are nearly tied: rounding decides a near tie. "Tokens identical: no"
alone cannot tell that from a bug; the position where the sequences part and the logit margin there
(small: a tie broken by rounding; large: a real difference) can.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["parting", "parting_text"]


def parting(ours: Tensor, theirs: Tensor, prompt_len: int, reference: nn.Module) -> dict[str, Any] | None:
    """The first new token where ``ours`` and ``theirs`` differ, or None where they are equal.

    Args:
        ours, theirs: (1, prompt_len + new) greedy generations from the same prompt.
        prompt_len: tokens of the prompt (equal in both).
        reference: a causal LM called as ``reference(ids) -> logits (1, N, vocab)`` (the fp32 model) that
            scores the common prefix.

    Returns:
        ``{"token": k (1-based among the new tokens), "of": new, "ours": id, "theirs": id,
        "margin": reference logit of ours - of theirs at that position, "spread": max - min logit there}``.

    Raises:
        ValueError: the two sequences differ in shape or in their prompts.
    """
    if ours.shape != theirs.shape or not torch.equal(ours[:, :prompt_len], theirs[:, :prompt_len]):
        raise ValueError(
            f"parting needs two generations of one prompt; got shapes {tuple(ours.shape)} and "
            f"{tuple(theirs.shape)} (or different prompts)"
        )
    differ = (ours[0, prompt_len:] != theirs[0, prompt_len:]).nonzero()  # (k, 1)
    if differ.numel() == 0:
        return None
    k = int(differ[0, 0])
    with torch.inference_mode():
        logits = reference(ours[:, : prompt_len + k])[0, -1].float()  # (vocab,)
    a, b = int(ours[0, prompt_len + k]), int(theirs[0, prompt_len + k])
    return {
        "token": k + 1,
        "of": ours.shape[1] - prompt_len,
        "ours": a,
        "theirs": b,
        "margin": float(logits[a] - logits[b]),
        "spread": float(logits.max() - logits.min()),
    }


def parting_text(part: dict[str, Any] | None) -> str:
    """``"yes"``, or where the tokens part and the reference's logit margin between the two choices."""
    if part is None:
        return "yes"
    return (
        f"no, they part at new token {part['token']} of {part['of']} (ours {part['ours']}, theirs "
        f"{part['theirs']}; fp32 logit margin {part['margin']:+.3g} of a {part['spread']:.3g} range)"
    )
