"""``human_judged(model)``: how well a model's embeddings agree with human judgements.

Three sets, all from :mod:`multihead.eval.data`:

- **Lee** (document similarity): Pearson correlation between the cosine similarity of the embeddings of
  each of the 1225 document pairs and the mean human similarity;
- **WordSim-353** (word relatedness): Spearman correlation between the cosine of the two words'
  embeddings (each word embedded as a one-word text) and the mean human score;
- **polarity** (sentiment): 5-fold cross-validated accuracy of a logistic regression probe on the
  sentence embeddings (the encoder stays frozen).

Each score comes with a percentile bootstrap 95% interval: pairs (Lee, WordSim) or sentences (polarity)
are resampled with replacement and the statistic recomputed (the probe's out-of-fold predictions are
kept; only the accuracy is resampled).

Shape legend: n texts, d embedding width, B batch, N tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .data import lee, polarity, wordsim353
from .metrics import bootstrap_ci, logistic_probe, pearson, spearman

__all__ = ["SETS", "embed", "human_judged"]

#: The sets, in report order: name -> (statistic, what it measures).
SETS = {
    "lee": ("pearson", "document similarity, 1225 pairs (Lee et al. 2005)"),
    "wordsim353": ("spearman", "word relatedness, 353 pairs (Finkelstein et al. 2002)"),
    "polarity": ("accuracy", "sentiment, 5-fold logistic probe, 200 sentences (Pang and Lee 2005)"),
}


@torch.no_grad()
def embed(
    model: Any,
    texts: Sequence[str],
    *,
    tokenize: Callable[[Sequence[str]], Sequence[Sequence[int]]] | None = None,
    batch_size: int = 16,
    max_tokens: int = 256,
) -> Tensor:
    """Embeddings (n, d) float32 of texts.

    With ``tokenize`` None the model must have ``.encode(texts) -> (n, d)`` (a SentenceEncoder). With a
    ``tokenize`` callable (texts -> id lists) the model must have ``.hidden_states(ids, attention_mask=)``
    (a TransformerLM): its final hidden states are mean-pooled over each text's first ``max_tokens``
    tokens.

    Raises:
        ValueError: a model with neither interface, or an empty text after tokenising.
    """
    if tokenize is None:
        if not callable(getattr(model, "encode", None)):
            raise ValueError(
                f"{type(model).__name__} has no .encode(texts); pass tokenize=<texts -> id lists> to "
                "mean-pool its hidden states (a TransformerLM)"
            )
        return torch.as_tensor(model.encode(list(texts))).float()  # (n, d)
    if not callable(getattr(model, "hidden_states", None)):
        raise ValueError(
            f"tokenize= needs a model with .hidden_states(ids, attention_mask=) (a TransformerLM), got "
            f"{type(model).__name__}; for an encoder with .encode leave tokenize=None"
        )
    seqs = [list(s)[:max_tokens] for s in tokenize(list(texts))]
    if any(len(s) == 0 for s in seqs):
        raise ValueError("tokenize returned an empty id list for some text; every text needs a token")
    p = next(iter(model.parameters()), None) if isinstance(model, nn.Module) else None
    device = torch.device("cpu") if p is None else p.device
    out = []
    for start in range(0, len(seqs), batch_size):
        batch = seqs[start : start + batch_size]
        N = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), N, dtype=torch.long, device=device)  # (B, N)
        real = torch.zeros(len(batch), N, dtype=torch.bool, device=device)  # (B, N)
        for r, s in enumerate(batch):
            ids[r, : len(s)] = torch.as_tensor(s, device=device)
            real[r, : len(s)] = True
        h = model.hidden_states(ids, attention_mask=real).float()  # (B, N, d)
        w = real.to(h.dtype).unsqueeze(-1)  # (B, N, 1)
        out.append(((h * w).sum(1) / w.sum(1)).cpu())  # (B, d)
    return torch.cat(out)  # (n, d)


def _cosines(e: Tensor) -> Tensor:
    e = F.normalize(e.double(), dim=-1)  # (n, d)
    return e @ e.T  # (n, n)


def human_judged(
    model: Any,
    *,
    tokenize: Callable[[Sequence[str]], Sequence[Sequence[int]]] | None = None,
    bootstrap: int = 200,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Scores of ``model``'s embeddings on the human-judged sets (see the module docstring).

    Args:
        model: an encoder with ``.encode(texts) -> (n, d)`` (``mh.pretrained.minilm()``), or, with
            ``tokenize``, a model with ``.hidden_states`` (a TransformerLM; mean-pooled final states).
        tokenize: texts -> token id lists, for a model without ``.encode``.
        bootstrap: resamples for the 95% intervals (0: no interval).
        seed: the probe's folds and the bootstrap resamples.

    Returns:
        ``{name: {"statistic", "score", "low", "high", "n"}}`` for name in :data:`SETS` ("low"/"high"
        the 95% interval, None when ``bootstrap`` is 0).

    Raises:
        ImportError: gensim (the data) is missing: ``pip install multihead[eval]``.
        ValueError: a model :func:`embed` cannot run, bootstrap < 0.
    """
    if isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or bootstrap < 0:
        raise ValueError(f"bootstrap must be an int >= 0 (resamples; 0 for none), got {bootstrap!r}")
    docs, human = lee()
    i, j = torch.triu_indices(len(docs), len(docs), offset=1)  # (2, 1225)
    lee_model = _cosines(embed(model, docs, tokenize=tokenize))[i, j]  # (1225,)
    lee_human = human[i, j]  # (1225,)

    pairs, ws_human = wordsim353()
    words = sorted({w for p in pairs for w in p})
    at = {w: k for k, w in enumerate(words)}
    cos = _cosines(embed(model, words, tokenize=tokenize))  # (W, W)
    ws_model = torch.stack([cos[at[a], at[b]] for a, b in pairs])  # (353,)

    texts, labels = polarity()
    right = logistic_probe(embed(model, texts, tokenize=tokenize), labels, seed=seed)  # (200,)

    stats: dict[str, tuple[Callable[[Tensor], float], int]] = {
        "lee": (lambda idx: pearson(lee_model[idx], lee_human[idx]), lee_model.numel()),
        "wordsim353": (lambda idx: spearman(ws_model[idx], ws_human[idx]), ws_model.numel()),
        "polarity": (lambda idx: float(right[idx].mean()), right.numel()),
    }
    out: dict[str, dict[str, Any]] = {}
    for name, (stat, n) in stats.items():
        score = stat(torch.arange(n))
        low = high = None
        if bootstrap:
            low, high = bootstrap_ci(stat, n, samples=bootstrap, seed=seed)
        out[name] = {"statistic": SETS[name][0], "score": score, "low": low, "high": high, "n": n}
    return out
