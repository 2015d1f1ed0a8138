"""Human-judged evaluation sets, read from the test data that ships inside the ``gensim`` wheel.

Nothing is downloaded: ``pip install multihead[eval]`` installs gensim, whose ``gensim/test/test_data/``
folder holds

- ``lee.cor`` and ``similarities0-1.txt``: 50 short news documents and the mean human similarity of
  every pair (Lee, Pincombe and Welsh, 2005, "An empirical evaluation of models of text document
  similarity"); the matrix is upper-triangular, 1225 pairs i < j;
- ``wordsim353.tsv``: 353 word pairs with the mean human relatedness on a 0-10 scale (Finkelstein et al.,
  2002, "Placing search in context: the concept revisited");
- ``pang_lee_polarity.cor``: 200 movie-review sentences labelled ``__label__pos`` / ``__label__neg``
  (a sample of Pang and Lee, 2005, "Seeing stars").

gensim is only used to find these files; it is imported when a loader is first called.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["EXTRA", "data_dir", "lee", "polarity", "wordsim353"]

#: The pip command that installs what these loaders read.
EXTRA = "pip install multihead[eval]"
_FILES = ("lee.cor", "similarities0-1.txt", "wordsim353.tsv", "pang_lee_polarity.cor")


def data_dir(files: Sequence[str] = _FILES) -> Path:
    """The folder of gensim's bundled test data.

    Args:
        files: the file names the caller reads (default: the human-judged sets').

    Raises:
        ImportError: gensim is not installed; the message gives the pip command.
        ValueError: the installed gensim lacks one of ``files`` (a trimmed install).
    """
    spec = importlib.util.find_spec("gensim")
    if spec is None or spec.origin is None:
        raise ImportError(
            f"the human-judged sets and the Wikipedia text ship inside the gensim package, which is not "
            f"installed: run `{EXTRA}` "
            "(or `pip install gensim`); nothing is downloaded at run time"
        )
    folder = Path(spec.origin).parent / "test" / "test_data"
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise ValueError(
            f"gensim at {Path(spec.origin).parent} lacks {missing} in test/test_data; reinstall it with "
            f"`pip install --force-reinstall gensim` (`{EXTRA}`)"
        )
    return folder


def lee() -> tuple[list[str], Tensor]:
    """The Lee et al. (2005) documents and their human similarity.

    Returns:
        docs: 50 texts; sims: (50, 50) float64, symmetric with a unit diagonal (the file's upper triangle
        mirrored). The 1225 pairs i < j are what :func:`~multihead.eval.human_judged` correlates.
    """
    folder = data_dir()
    docs = [
        d.strip()
        for d in (folder / "lee.cor").read_text(encoding="cp1252", errors="replace").splitlines()
        if d.strip()
    ]
    rows = [
        [float(x) for x in line.split()]
        for line in (folder / "similarities0-1.txt").read_text(encoding="ascii").splitlines()
        if line.strip()
    ]
    sims = torch.tensor(rows, dtype=torch.float64)  # (50, 50), upper triangle filled
    if sims.shape != (len(docs), len(docs)):
        raise ValueError(f"lee.cor has {len(docs)} documents but similarities0-1.txt is {tuple(sims.shape)}")
    upper = torch.triu(sims, diagonal=1)  # (50, 50)
    return docs, upper + upper.T + torch.eye(len(docs), dtype=torch.float64)


def wordsim353() -> tuple[list[tuple[str, str]], Tensor]:
    """WordSim-353: the word pairs and their mean human relatedness (n,) float64 on a 0-10 scale."""
    pairs: list[tuple[str, str]] = []
    scores: list[float] = []
    for line in (data_dir() / "wordsim353.tsv").read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        a, b, s = line.split("\t")[:3]
        pairs.append((a.strip(), b.strip()))
        scores.append(float(s))
    return pairs, torch.tensor(scores, dtype=torch.float64)


def polarity() -> tuple[list[str], Tensor]:
    """The labelled movie-review sentences: texts and labels (n,) long, 1 positive, 0 negative."""
    texts: list[str] = []
    labels: list[int] = []
    for line in (
        (data_dir() / "pang_lee_polarity.cor").read_text(encoding="cp1252", errors="replace").splitlines()
    ):
        if not line.strip():
            continue
        label, _, text = line.strip().partition(" ")
        if label not in ("__label__pos", "__label__neg"):
            raise ValueError(f"pang_lee_polarity.cor: unknown label {label!r} (expected __label__pos/neg)")
        texts.append(text)
        labels.append(int(label == "__label__pos"))
    return texts, torch.tensor(labels, dtype=torch.long)
