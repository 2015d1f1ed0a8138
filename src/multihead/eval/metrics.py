"""The statistics of the human-judged evaluation: correlations, a logistic probe, bootstrap intervals.

All in float64 torch, deterministic for a given seed.

Shape legend: n items (pairs or sentences), d embedding width, F folds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["bootstrap_ci", "logistic_probe", "pearson", "ranks", "spearman", "stratified_folds"]


def _check_pair(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    if x.dim() != 1 or x.shape != y.shape or x.numel() < 2:
        raise ValueError(
            f"x and y must be 1-d of the same length >= 2, got {tuple(x.shape)} and {tuple(y.shape)}"
        )
    return x.double(), y.double()


def pearson(x: Tensor, y: Tensor) -> float:
    """Pearson correlation of x (n,) and y (n,); 0.0 when either is constant."""
    x, y = _check_pair(x, y)
    xc, yc = x - x.mean(), y - y.mean()
    den = (xc.square().sum() * yc.square().sum()).sqrt()
    return 0.0 if den == 0 else float((xc * yc).sum() / den)


def ranks(x: Tensor) -> Tensor:
    """Ranks (n,) float64 from 1, ties sharing their mean rank (as Spearman's correlation needs)."""
    order = torch.argsort(x, stable=True)
    sx = x[order]
    r = torch.empty(x.numel(), dtype=torch.float64)  # (n,)
    i, n = 0, x.numel()
    while i < n:
        j = i
        while j + 1 < n and sx[j + 1] == sx[i]:
            j += 1
        r[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman rank correlation of x (n,) and y (n,): Pearson of their (tie-averaged) ranks."""
    x, y = _check_pair(x, y)
    return pearson(ranks(x), ranks(y))


def stratified_folds(labels: Tensor, folds: int, seed: int) -> Tensor:
    """Fold index (n,) long for each item: each class shuffled (seeded) then dealt round-robin to folds.

    Raises:
        ValueError: folds < 2 or more folds than items of some class.
    """
    if folds < 2:
        raise ValueError(f"folds must be >= 2, got {folds}")
    g = torch.Generator().manual_seed(seed)
    fold = torch.empty(labels.numel(), dtype=torch.long)  # (n,)
    offset = 0
    for c in torch.unique(labels):
        idx = torch.nonzero(labels == c).flatten()
        if idx.numel() < folds:
            raise ValueError(f"class {int(c)} has {idx.numel()} items, fewer than folds={folds}")
        idx = idx[torch.randperm(idx.numel(), generator=g)]
        fold[idx] = (torch.arange(idx.numel()) + offset) % folds
        offset += idx.numel()
    return fold


def _fit_logistic(x: Tensor, y: Tensor, c: float, iters: int = 50) -> Tensor:
    """Weights (d + 1,) (last: intercept) minimising 0.5 ||w||^2 + c * sum log-loss, by Newton's method.

    The objective is strictly convex, so Newton steps from zero converge to the one minimum.
    """
    n, d = x.shape
    xa = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], dim=1)  # (n, d + 1)
    reg = torch.ones(d + 1, dtype=x.dtype)
    reg[-1] = 0.0  # the intercept is not penalised
    w = torch.zeros(d + 1, dtype=x.dtype)
    for _ in range(iters):
        p = torch.sigmoid(xa @ w)  # (n,)
        grad = reg * w + c * xa.T @ (p - y)  # (d + 1,)
        hess = torch.diag(reg) + c * (xa.T * (p * (1 - p))) @ xa  # (d + 1, d + 1)
        hess += 1e-10 * torch.eye(d + 1, dtype=x.dtype)
        step = torch.linalg.solve(hess, grad)
        w = w - step
        if float(step.abs().max()) < 1e-10:
            break
    return w


def logistic_probe(
    features: Tensor, labels: Tensor, *, folds: int = 5, c: float = 1.0, seed: int = 0
) -> Tensor:
    """Out-of-fold correctness of an L2-regularised logistic regression on fixed features.

    Each fold's labels are predicted by a probe fitted (:math:`\\min 0.5 \\|w\\|^2 + c \\sum` log-loss,
    intercept unpenalised) on the other folds.

    Args:
        features: (n, d) embeddings.
        labels: (n,) in {0, 1}.
        folds: F stratified folds (:func:`stratified_folds`).
        c: inverse regularisation strength.
        seed: fold assignment.

    Returns:
        (n,) float64, 1.0 where the item's out-of-fold prediction is right: its mean is the accuracy.

    Raises:
        ValueError: shapes that disagree, labels outside {0, 1}, c <= 0.
    """
    if features.dim() != 2 or labels.shape != (features.shape[0],):
        raise ValueError(
            f"features must be (n, d) and labels (n,), got {tuple(features.shape)} and {tuple(labels.shape)}"
        )
    if not bool(((labels == 0) | (labels == 1)).all()):
        raise ValueError("labels must be 0 or 1")
    if not c > 0:
        raise ValueError(f"c must be > 0, got {c}")
    x, y = features.double(), labels.double()
    fold = stratified_folds(labels, folds, seed)
    right = torch.zeros(x.shape[0], dtype=torch.float64)  # (n,)
    for f in range(folds):
        test = fold == f
        w = _fit_logistic(x[~test], y[~test], c)
        pred = (x[test] @ w[:-1] + w[-1]) > 0  # (n_test,)
        right[test] = (pred == labels[test].bool()).double()
    return right


def bootstrap_ci(
    stat: Callable[[Tensor], float], n: int, *, samples: int = 200, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``stat(idx)`` over ``samples`` resamples idx (n,) with
    replacement (a seeded generator; the same seed gives the same interval).

    Raises:
        ValueError: samples < 1 or a level outside (0, 1).
    """
    if samples < 1 or not 0 < level < 1:
        raise ValueError(f"samples must be >= 1 and level in (0, 1), got {samples} and {level}")
    g = torch.Generator().manual_seed(seed)
    vals = torch.tensor(
        [stat(torch.randint(n, (n,), generator=g)) for _ in range(samples)], dtype=torch.float64
    )
    lo, hi = torch.quantile(vals, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return float(lo), float(hi)
