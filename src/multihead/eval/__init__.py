"""Evaluation: human-judged scores of embeddings (document similarity, Lee et al. 2005; word relatedness,
WordSim-353; sentiment, a logistic probe on Pang and Lee's polarity sentences), and the perplexity of a
language model (transformers' sliding-window method) on held-out English Wikipedia articles.

    scores = mh.eval.human_judged(mh.pretrained.minilm())    # {"lee": {"score": 0.66, "low": ...}, ...}
    texts = [a.text for a in mh.eval.wikipedia.held_out()]
    ppl = mh.eval.perplexity(mh.pretrained.smollm2(), texts[:4])   # a float

The data ship inside the ``gensim`` wheel (``pip install multihead[eval]``); nothing is downloaded.
"""

from . import wikipedia
from .data import data_dir, lee, polarity, wordsim353
from .human_judged import SETS, embed, human_judged
from .metrics import bootstrap_ci, logistic_probe, pearson, spearman
from .perplexity import PerplexityScores, perplexity, perplexity_scores

__all__ = [
    "SETS",
    "PerplexityScores",
    "bootstrap_ci",
    "data_dir",
    "embed",
    "human_judged",
    "lee",
    "logistic_probe",
    "pearson",
    "perplexity",
    "perplexity_scores",
    "polarity",
    "spearman",
    "wikipedia",
    "wordsim353",
]
