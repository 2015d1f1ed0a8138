"""Synthetic recall data: multi-query associative recall (MQAR; Arora, Eyuboglu et al., "Zoology", 2023).

MQAR is the task that separates exact attention from its cheap substitutes: a sequence lists key-value
pairs, then asks for the values of those keys again, each query at a power-law distributed distance
from the start of the query region. Exact attention solves it with an induction head; fixed-size states
(linear attention, Performer) and low-rank summaries of the sequence lose pairs as their number grows.

One example with ``n_pairs = 2`` (``random_fill=False``; keys from [1, V/2), values from [V/2, V))::

             key  val  key  val            query                         query
    inputs:   2    8    4    7    0    0    4    0    0    0    0    0    2    0    0    0
    labels: -100 -100 -100 -100 -100 -100   7  -100 -100 -100 -100 -100   8  -100 -100 -100

The label at a query position is the value paired with that key earlier (next-token prediction: the
model reads the key and must output its value); -100 elsewhere (ignored by ``F.cross_entropy``). With
``random_fill=True`` (the paper's default) the zeros become random tokens from the whole vocabulary.

The layout follows the paper's reference generator: disjoint key and value vocabularies, each example's
keys and values drawn without replacement, pairs first (``2 * n_pairs`` tokens), then queries on the
even offsets of the remaining region at gaps drawn without replacement with ``P(gap = g) ~ g^(a - 1)``
(``a = power_a``; small ``a`` puts most queries early, ``a = 1`` is uniform).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["IGNORE_INDEX", "mqar"]

IGNORE_INDEX = -100  #: the label of positions where nothing is asked (``F.cross_entropy``'s default)
_CHUNK = 1024  # examples drawn at once: bounds the (chunk, vocab/2) random scores of the key draw


def _check(n: int, seq_len: int, n_pairs: int, vocab: int, power_a: float) -> None:
    for name, val, low in (
        ("n", n, 1),
        ("seq_len", seq_len, 4),
        ("n_pairs", n_pairs, 1),
        ("vocab", vocab, 4),
    ):
        if isinstance(val, bool) or not isinstance(val, int) or val < low:
            raise ValueError(f"mqar {name} must be an int >= {low}, got {val!r}")
    if seq_len % 2:
        raise ValueError(f"mqar seq_len must be even (queries sit on even offsets), got {seq_len}")
    if 4 * n_pairs > seq_len:
        raise ValueError(
            f"mqar needs seq_len >= 4 * n_pairs (the pairs, then a query slot per pair in the other half), "
            f"got seq_len={seq_len}, n_pairs={n_pairs}; use n_pairs <= {seq_len // 4}"
        )
    if vocab // 2 - 1 < n_pairs:
        raise ValueError(
            f"mqar vocab={vocab} leaves {vocab // 2 - 1} keys for n_pairs={n_pairs}; "
            f"use vocab >= {2 * n_pairs + 2}"
        )
    if isinstance(power_a, bool) or not isinstance(power_a, (int, float)) or not 0.0 < power_a <= 1.0:
        raise ValueError(f"mqar power_a must be in (0, 1] (1 = uniform gaps), got {power_a!r}")


def _draw_distinct(n: int, pool: int, size: int, g: torch.Generator) -> Tensor:
    """(n, size) indices in [0, pool), distinct within each row, uniformly without replacement."""
    rows = []
    for start in range(0, n, _CHUNK):
        m = min(_CHUNK, n - start)
        scores = torch.rand(m, pool, generator=g)  # (m, pool): the top `size` are a uniform subset
        rows.append(scores.topk(size, dim=1).indices)  # (m, size)
    return torch.cat(rows)  # (n, size)


def mqar(
    n: int,
    seq_len: int,
    n_pairs: int,
    vocab: int = 8192,
    power_a: float = 0.01,
    seed: int = 0,
    *,
    random_fill: bool = True,
) -> tuple[Tensor, Tensor]:
    """``n`` MQAR examples: ``inputs`` (n, seq_len) int64 token ids and ``labels`` (n, seq_len) int64.

    Args:
        n: number of examples.
        seq_len: tokens per example (even, >= 4 * n_pairs).
        n_pairs: key-value pairs per example; each is queried exactly once.
        vocab: vocabulary size V: keys come from [1, V // 2), values from [V // 2, V).
        power_a: exponent a of the gap law ``P(gap = g) ~ g^(a - 1)``, in (0, 1].
        seed: seeds a private generator; the same arguments give the same data.
        random_fill: replace the filler zeros by random tokens from [0, V) (the paper's default).

    Returns:
        (inputs, labels): ``labels[i, p]`` is the value paired with key ``inputs[i, p]`` at the n_pairs
        query positions p of example i, and -100 everywhere else.

    Raises:
        ValueError: sizes that are not positive ints, an odd seq_len, seq_len < 4 * n_pairs, a vocab
            too small for n_pairs distinct keys, power_a outside (0, 1].
    """
    _check(n, seq_len, n_pairs, vocab, power_a)
    g = torch.Generator().manual_seed(int(seed))
    half = vocab // 2
    keys = 1 + _draw_distinct(n, half - 1, n_pairs, g)  # (n, P) in [1, V/2)
    values = half + _draw_distinct(n, vocab - half, n_pairs, g)  # (n, P) in [V/2, V)
    context = 2 * n_pairs
    pairs = torch.stack((keys, values), dim=2).reshape(n, context)  # (n, 2P): k0 v0 k1 v1 ...

    space = (seq_len - context) // 2  # query slots: the even offsets of the query region
    law = power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (power_a - 1)  # (space,)
    gaps = torch.multinomial(law.expand(n, space), n_pairs, replacement=False, generator=g)  # (n, P)

    inputs = torch.zeros(n, seq_len, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
    inputs[:, :context] = pairs
    where = context + 2 * gaps  # (n, P) query positions
    inputs.scatter_(1, where, keys)
    labels.scatter_(1, where, values)
    if random_fill:
        filler = inputs == 0
        inputs[filler] = torch.randint(vocab, (int(filler.sum()),), generator=g)
    return inputs, labels
