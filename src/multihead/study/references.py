"""The report's reference list: every work a section names ("Clark et al.", "Zoology") with its citation.

:func:`references` reads the rendered sections and lists the works they name, in the order they first
appear, as one more section at the end of the report. A name in a section without an entry here is a
gap that ``tests/test_report_sentences.py`` catches.
"""

from __future__ import annotations

import re

from .context import Section

__all__ = ["REFERENCES", "named_works", "references"]

#: how the report names a work -> its citation
REFERENCES: dict[str, str] = {
    "Zoology": "Arora, Eyuboglu, Timalsina, Johnson, Poli, Zou, Rudra, Ré (2023). Zoology: Measuring and "
    "Improving Recall in Efficient Language Models. arXiv:2312.04927 (the MQAR task).",
    "Clark et al.": "Clark, Khandelwal, Levy, Manning (2019). What Does BERT Look At? An Analysis of BERT's "
    "Attention. BlackboxNLP workshop at ACL 2019. arXiv:1906.04341.",
    "Michel et al.": "Michel, Levy, Neubig (2019). Are Sixteen Heads Really Better than One? NeurIPS. "
    "arXiv:1905.10650.",
    "Lee et al.": "Lee, Pincombe, Welsh (2005). An Empirical Evaluation of Models of Text Document "
    "Similarity. Proceedings of the 27th Annual Conference of the Cognitive Science Society.",
    "WordSim-353": "Finkelstein, Gabrilovich, Matias, Rivlin, Solan, Wolfman, Ruppin (2002). Placing Search "
    "in Context: The Concept Revisited. ACM Transactions on Information Systems 20(1), 116-131.",
    "Pang-Lee": "Pang, Lee (2005). Seeing Stars: Exploiting Class Relationships for Sentiment Categorization "
    "with Respect to Rating Scales. ACL 2005 (the sentence polarity data).",
    "FlashAttention": "Dao, Fu, Ermon, Rudra, Ré (2022). FlashAttention: Fast and Memory-Efficient Exact "
    "Attention with IO-Awareness. NeurIPS. arXiv:2205.14135.",
}

_ET_AL = re.compile(r"\b([A-Z][a-z]+) et al\.")


def named_works(text: str) -> list[str]:
    """The works ``text`` names, in order of first appearance: every "<Name> et al." and every key of
    :data:`REFERENCES` (whether or not it has an entry: a missing one shows as a gap)."""
    found: dict[int, str] = {}
    for m in _ET_AL.finditer(text):
        found.setdefault(m.start(), f"{m.group(1)} et al.")
    for key in REFERENCES:
        at = text.find(key)
        if at >= 0 and not key.endswith("et al."):
            found.setdefault(at, key)
    return list(dict.fromkeys(found[i] for i in sorted(found)))


def references(sections: list[Section]) -> Section | None:
    """A "References" section with the citation of every work the sections name; None when none does."""
    works = named_works("\n".join(s.markdown() for s in sections))
    if not works:
        return None
    lines = [f"{w}: {REFERENCES.get(w, 'no citation recorded')}" for w in works]
    return Section("references", "References", {"works": {w: REFERENCES.get(w) for w in works}}, [], lines)
