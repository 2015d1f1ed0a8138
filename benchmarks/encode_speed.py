"""MiniLM encoding speed: multihead's ``encode`` against sentence-transformers' own ``encode``.

    python benchmarks/encode_speed.py                       # 256 docstrings + 256 short texts, 3 rounds
    python benchmarks/encode_speed.py --threads 1 --rounds 5 --json

Both sides get the same texts, batch size 32 and normalised embeddings; both sort by length before
batching (sentence-transformers by characters, multihead by tokens) and return the input order. The
corpora: the first ``--docs`` standard-library docstrings (``mh.pretrained.stdlib_docstrings``, up to 256
tokens each) and a set of short texts, the first sentence of each of those docstrings.

Contestants run interleaved, round after round, so a load change on a shared machine hits all of them;
the ratios come from the medians of the same run (``multihead.bench.timing``: samples long enough for
the clock, a ratio whose spreads overlap reads "same within noise"). Reports texts/s (wall clock), the
ratio to sentence-transformers in wall-clock and in CPU time (the process's, all threads: on a machine shared
with other jobs the CPU-time ratio at ``--threads 1`` is the steadier measure of the work done),
the padded/real token counts of each side's batches, and the min cosine of each multihead path to
sentence-transformers' embeddings. Needs sentence-transformers and the bundled weights.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence

import torch

import multihead as mh
from multihead.bench import timing


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


def _ratio(x: float | None, same: bool) -> str:
    return timing.TOO_SHORT if x is None else timing.SAME if same else f"{x:.2f}x"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=256, help="standard-library docstrings (default 256)")
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved samples at least (more while under 0.2 s); medians"
    )
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    docs = mh.pretrained.stdlib_docstrings(args.docs)
    ours = mh.pretrained.minilm()
    prepacked = mh.quant.quantize(ours, weights="fp32", kv=None, kernel="onednn")  # oneDNN layout
    st = SentenceTransformer(str(mh.pretrained.minilm_dir()), device="cpu")
    report = {
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "docstrings": bench(docs, args.rounds, args.batch_size, st, ours, prepacked),
        "short texts": bench(short_texts(docs), args.rounds, args.batch_size, st, ours, prepacked),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return report
    print(
        f"MiniLM encode, batch {args.batch_size}, {report['threads']} torch threads, medians of {args.rounds}"
    )
    for corpus in ("docstrings", "short texts"):
        r = report[corpus]
        tok = r["tokens"]
        print(
            f"\n{corpus}: {r['texts']} texts, {tok['real']} real tokens; padded batches compute "
            f"{tok['sentence-transformers padded']} (sentence-transformers) / {tok['multihead padded']} "
            "(multihead padded) tokens"
        )
        print(f"{'contestant':32s} {'texts/s':>9s} {'vs ST':>7s} {'CPU time vs ST':>15s} {'min cosine':>11s}")
        for name, rate in r["texts_per_s"].items():
            cos = r["min_cosine_vs_st"].get(name)
            cos_s = f"{cos:.7f}" if cos is not None else ""
            rate_s = timing.TOO_SHORT if rate is None else f"{rate:.1f}"
            wall_s, cpu_s = (
                _ratio(r[key][name], r[f"{key}_within_noise"][name])
                for key in ("ratio_vs_st", "cpu_ratio_vs_st")
            )
            print(f"{name:32s} {rate_s:>9s} {wall_s:>7s} {cpu_s:>15s} {cos_s:>11s}")
    return report


if __name__ == "__main__":
    main()
