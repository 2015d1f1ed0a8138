"""The study's MiniLM section: all-MiniLM-L6-v2 through multihead against its references, and its speed.

Quick (the default study): 16 short standard-library docstrings through multihead (fp32, packed) against the
same model in float64 on the ``reference`` backend (the project's oracle, padded batches), and packed vs
padded throughput. Full (``--full``): 256 docstrings, plus sentence-transformers - the model's own
implementation - for the embeddings and the speed (its import alone takes seconds, so quick skips it;
the test suite checks it on every run).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ...bench import timing
from ...nn.attention import MultiHeadAttention
from ...pretrained.corpus import stdlib_docstrings
from ...pretrained.sentence_encoder import SentenceEncoder
from ...pretrained.sentence_encoder import minilm as load_minilm

if TYPE_CHECKING:  # study.py imports this module: import its classes at call time, not here
    from ..context import Section, StudyContext

__all__ = ["WAYS", "minilm", "packing_note"]


def _gold(encoder: SentenceEncoder) -> SentenceEncoder:
    """The same model in float64 with every attention on the ``reference`` backend."""
    gold = copy.deepcopy(encoder).double()
    for m in gold.modules():
        if isinstance(m, MultiHeadAttention):
            m.backend = "reference"
    return gold


def _rate(fn: Callable[[], object], n: int) -> float | None:
    """Texts per second of ``fn`` (:func:`multihead.bench.timing.measure`), None if too short to measure."""
    return timing.measure(fn, warmup=0, min_samples=3, max_seconds=3.0).rate(n)


#: the three ways multihead runs a batch (:mod:`multihead.pretrained.sentence_encoder`), as ``packed=``
WAYS = {"multihead (default: unpadded)": None, "multihead packed": True, "multihead padded": False}


def _speeds(encoder: SentenceEncoder, texts: list[str]) -> dict[str, timing.Timing]:
    """Seconds per ``encode`` of ``texts`` for each of :data:`WAYS`, samples interleaved (a change of
    load hits all three alike), each with its spread."""
    calls = {k: (lambda p=p: encoder.encode(texts, batch_size=32, packed=p)) for k, p in WAYS.items()}
    return timing.measure_all(calls, warmup=0, min_samples=5, max_seconds=3.0)


def packing_note(times: dict[str, timing.Timing], positions: dict[str, Any]) -> str:
    """What packing bought in this run, from the same timings the speed table shows: packed against
    padded (:func:`multihead.bench.timing.compare`), with the positions each computes."""
    packed, padded = times.get("multihead packed"), times.get("multihead padded")
    if packed is None or padded is None:
        return ""
    verdict = timing.compare(packed, padded)
    saved = 1 - positions["packed_positions"] / max(positions["padded_positions"], 1)
    where = (
        f"Packing saves {saved:.0%} of the positions here ({positions['padded_positions']} padded, "
        f"{positions['packed_positions']} packed)"
    )
    if verdict.ratio is None:
        return f"{where}; packed against padded: {verdict}."
    if verdict.same:
        return f"{where}, and packed and padded encode at the same speed within noise."
    if verdict.ratio < 1:
        return f"{where}, and packed rows take {verdict.ratio:.2f}x padded batches' time."
    return (
        f"{where}, yet packed rows take {verdict.ratio:.2f}x padded batches' time: the document mask "
        "that keeps the packed sequences apart costs more in kernel overhead than the positions it saves "
        "(sorted batches of similar lengths pad little). That is why encode's default runs neither: the "
        "token-wise work on the real tokens only and attention on the short padded batches (the first row)."
    )


def _positions(encoder: SentenceEncoder, texts: list[str], batch: int) -> dict[str, int]:
    """Real tokens, and the positions a padded and a packed run compute, batch by batch."""
    lengths = sorted((len(s) for s in encoder.tokenize(texts)), reverse=True)
    padded = packed = 0
    for i in range(0, len(lengths), batch):
        part = lengths[i : i + batch]
        padded += len(part) * part[0]
        packed += sum(part)
    return {"tokens": sum(lengths), "padded_positions": padded, "packed_positions": packed}


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    return {
        "min_cosine": float((a.double() * b.double()).sum(-1).min()),
        "max_abs": float((a - b).abs().max()),
    }


def _st_reference(texts: list[str], ctx: StudyContext) -> tuple[torch.Tensor | None, float | None, str]:
    """sentence-transformers' embeddings and docs/s, or (None, None, why not)."""
    if ctx.quick:
        return None, None, "quick run: sentence-transformers is compared in `multihead study --full`"
    try:
        from sentence_transformers import SentenceTransformer

        from ...pretrained.sentence_encoder import minilm_dir

        st = SentenceTransformer(str(minilm_dir()), device="cpu")
    except ImportError as e:
        return None, None, f"sentence-transformers unavailable ({e}); pip install -e '.[oracles]'"
    ref = st.encode(texts, batch_size=32, normalize_embeddings=True, convert_to_tensor=True)
    rate = _rate(lambda: st.encode(texts, batch_size=32, normalize_embeddings=True), len(texts))
    return ref, rate, "sentence-transformers, batch 32"


def minilm(ctx: StudyContext) -> Section:
    """all-MiniLM-L6-v2 through multihead vs its float64 oracle (and sentence-transformers), speed."""
    from ..context import Section, Table

    title = "MiniLM: a real model through multihead"
    try:
        encoder = load_minilm()
    except ImportError as e:
        return Section("minilm", title, {"skipped": str(e)}, notes=[f"Skipped: {e}"])
    n = 16 if ctx.quick else 256
    texts = stdlib_docstrings(n, max_chars=400 if ctx.quick else None)
    ctx.step("multihead fp32, packed", 0.0)
    ours = encoder.encode(texts, batch_size=32, packed=True)
    assert isinstance(ours, torch.Tensor)
    ctx.step("float64 reference backend", 0.2)
    gold = _gold(encoder).encode(texts, batch_size=32, packed=False)  # another path: padded, float64
    assert isinstance(gold, torch.Tensor)
    ctx.step("sentence-transformers", 0.5)
    ref, st_rate, st_note = _st_reference(texts, ctx)
    ctx.step("throughput", 0.8)
    times = _speeds(encoder, texts)
    figures = {k: timing.rate_figure(t, n, fix="run `multihead study --full` (more texts a call)")
               for k, t in times.items()}  # fmt: skip
    rates = {k: f.value for k, f in figures.items()}
    if st_rate is not None:
        rates["sentence-transformers"] = st_rate
    vs_gold = _compare(ours, gold)
    vs_st = None if ref is None else _compare(ours, ref)
    data = {
        "docs": n,
        **_positions(encoder, texts, 32),
        "vs_gold": vs_gold,
        "vs_sentence_transformers": vs_st,
        "docs_per_s": rates,
    }
    rows = [
        ["float64 reference backend (padded)", f"{vs_gold['min_cosine']:.8f}", f"{vs_gold['max_abs']:.1e}"]
    ]
    if vs_st is not None:
        rows.append(["sentence-transformers", f"{vs_st['min_cosine']:.8f}", f"{vs_st['max_abs']:.1e}"])
    parity = Table(
        f"multihead (fp32, packed) against references, {n} standard-library docstrings",
        ["reference", "min cosine", "max |diff|"],
        rows,
        align="lrr",
    )
    cells = [[k, f.text()] for k, f in figures.items()]
    if st_rate is not None:
        cells.append(["sentence-transformers", f"{st_rate:.1f}"])
    speed = Table(
        "encoding throughput, docs/s: the median of interleaved samples, the spread their quartiles allow "
        "(sentence-transformers: timed on its own)",
        ["implementation", "docs/s"],
        cells,
        align="lr",
    )
    notes = [
        f"{data['tokens']} real tokens: padded batches compute {data['padded_positions']} positions, packed "
        f"rows {data['packed_positions']} (sequences concatenated under mh.document, positions restarting "
        f"per sequence; the attention skips the tiles between sequences). {st_note}.",
        packing_note(times, data),
    ]
    return Section("minilm", title, data, [parity, speed], notes)
