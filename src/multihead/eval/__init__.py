"""Human-judged evaluation of embeddings: document similarity (Lee et al. 2005), word relatedness
(WordSim-353) and sentiment (a logistic probe on Pang and Lee's polarity sentences).

    scores = mh.eval.human_judged(mh.pretrained.minilm())    # {"lee": {"score": 0.66, "low": ...}, ...}

The data ship inside the ``gensim`` wheel (``pip install multihead[eval]``); nothing is downloaded.
"""

from .data import data_dir, lee, polarity, wordsim353
from .human_judged import SETS, embed, human_judged
from .metrics import bootstrap_ci, logistic_probe, pearson, spearman

__all__ = [
    "SETS",
    "bootstrap_ci",
    "data_dir",
    "embed",
    "human_judged",
    "lee",
    "logistic_probe",
    "pearson",
    "polarity",
    "spearman",
    "wordsim353",
]
