"""What ``benchmarks/encode_speed.py`` measures: MiniLM's ``encode`` in multihead (unpadded, padded,
packed, oneDNN-prepacked) against sentence-transformers' own on the same texts, batch size and
normalised embeddings, interleaved (:mod:`multihead.bench.timing`), in wall-clock and in CPU time, with
each side's padded token counts and the min cosine to sentence-transformers' embeddings. The models are
passed in (any object with sentence-transformers' or multihead's ``encode``), so tests drive it with fake
encoders and a fake clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from . import timing

__all__ = ["PREPACKED", "bench", "padded_tokens", "ratio_text", "short_texts", "timed"]


def short_texts(docs: Sequence[str]) -> list[str]:
    """The first sentence (up to the first period or line end) of each text."""
    return [d.split(".")[0].split("\n")[0].strip() or d[:40] for d in docs]


def padded_tokens(lengths: list[int], order: list[int], batch_size: int) -> int:
    """Tokens a padded run over ``order`` in batches of ``batch_size`` computes (pad included)."""
    return sum(
        max(lengths[i] for i in order[s : s + batch_size]) * len(order[s : s + batch_size])
        for s in range(0, len(order), batch_size)
    )


PREPACKED = "multihead prepacked fp32 (quantize(weights='fp32'))"


def bench(
    texts: list[str],
    rounds: int,
    batch_size: int,
    st,
    ours,
    prepacked,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] = time.process_time,
) -> dict:
    """Encode ``texts`` with sentence-transformers (``st``), multihead (``ours``: unpadded, padded and
    packed) and its oneDNN-prepacked copy (``prepacked``), in batches of ``batch_size``, interleaved for
    at least ``rounds`` samples (:func:`timed`).

    Returns:
        ``{"texts", "tokens" (real, and computed by each side's padded batches), "min_cosine_vs_st",
        "texts_per_s" (None: too short to measure, with "why_no_rate"), "ratio_vs_st",
        "cpu_ratio_vs_st" (sentence-transformers' time over ours: above 1 faster) and their
        "_within_noise" flags}``.
    """
    ref = st.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_tensor=True)
    contestants: dict[str, Callable[[], object]] = {
        "sentence-transformers": lambda: st.encode(texts, batch_size=batch_size, normalize_embeddings=True),
        "multihead (default: unpadded)": lambda: ours.encode(texts, batch_size=batch_size),
        "multihead padded": lambda: ours.encode(texts, batch_size=batch_size, packed=False),
        "multihead packed": lambda: ours.encode(texts, batch_size=batch_size, packed=True),
        PREPACKED: lambda: prepacked.encode(texts, batch_size=batch_size),
    }
    cosine = {}
    for name, model, packed in (
        ("multihead (default: unpadded)", ours, None),
        ("multihead padded", ours, False),
        (PREPACKED, prepacked, None),
    ):
        got = model.encode(texts, batch_size=batch_size, packed=packed)
        cosine[name] = float((got * ref.cpu()).sum(-1).min())
    wall, cpu = timed(contestants, rounds, clock, cpu_clock)
    st_name = "sentence-transformers"
    vs = {k: timing.compare(wall[st_name], t) for k, t in wall.items()}  # ST's time / ours: > 1 faster
    cpu_vs = {k: timing.compare(cpu[st_name], t) for k, t in cpu.items()}
    lengths = [len(s) for s in ours.tokenize(texts)]
    by_chars = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    by_tokens = sorted(range(len(texts)), key=lambda i: -lengths[i])
    return {
        "texts": len(texts),
        "tokens": {
            "real": sum(lengths),
            "sentence-transformers padded": padded_tokens(lengths, by_chars, batch_size),
            "multihead padded": padded_tokens(lengths, by_tokens, batch_size),
        },
        "min_cosine_vs_st": cosine,
        "texts_per_s": {k: t.rate(len(texts)) for k, t in wall.items()},
        "why_no_rate": {k: t.why for k, t in wall.items() if not t.ok},
        "ratio_vs_st": {k: c.ratio for k, c in vs.items()},
        "ratio_vs_st_within_noise": {k: c.same for k, c in vs.items()},
        "cpu_ratio_vs_st": {k: c.ratio for k, c in cpu_vs.items()},
        "cpu_ratio_vs_st_within_noise": {k: c.same for k, c in cpu_vs.items()},
    }


def timed(
    contestants: dict[str, Callable[[], object]],
    rounds: int,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] = time.process_time,
) -> tuple[dict[str, timing.Timing], dict[str, timing.Timing]]:
    """Wall time (:func:`multihead.bench.timing.measure_all`: interleaved samples, at least ``rounds``)
    and CPU time per call of every contestant; the CPU time is read around each call of the same
    samples and summarised by :func:`multihead.bench.timing.from_samples` ("too short to measure"
    under 50 ticks of ``cpu_clock``)."""
    cpu: dict[str, list[float]] = {k: [] for k in contestants}

    def with_cpu(name: str, fn: Callable[[], object]) -> Callable[[], None]:
        def call() -> None:
            start = cpu_clock()
            fn()
            cpu[name].append(cpu_clock() - start)

        return call

    wall = timing.measure_all(
        {k: with_cpu(k, fn) for k, fn in contestants.items()}, min_samples=rounds, warmup=0, clock=clock
    )
    floor = 50 * (timing.clock_resolution(cpu_clock) or float("inf"))
    return wall, {k: timing.from_samples(v, floor=floor) for k, v in cpu.items()}


def ratio_text(x: float | None, same: bool) -> str:
    """A ratio to sentence-transformers as text: "1.23x", "same within noise", or "too short to measure"."""
    return timing.TOO_SHORT if x is None else timing.SAME if same else f"{x:.2f}x"
