"""``multihead bench hf``: multihead as a Hugging Face attention backend against transformers' own.

A Mistral-shaped model (transformers ``MistralConfig``: 2 layers, d=512, 8 heads, sliding window 1024,
random weights, fp32, batch 1) built offline, once per attention implementation, each in its own worker
process (``python -m multihead.bench.hf_worker --worker IMPL``,
:mod:`multihead.bench.hf_worker`), so that one implementation's peak memory never
hides behind another's freed pages:

* prefill at every N of ``lengths``: wall time of ``model.model(input_ids)`` (median and spread of at
  least ``repeats`` rounds, the implementations interleaved inside each round; a ratio whose spreads
  overlap reads "same within noise"), the peak resident set above the loaded model
  (Linux ``VmHWM`` after a ``clear_refs`` reset, glibc's mmap threshold fixed), and the max |difference|
  of the last hidden state against "sdpa"; "multihead" against "sdpa", "eager" (skipped above
  ``eager_cap`` tokens: it holds (1, 8, N, N) fp32 scores per layer) and "flex_attention" (compiled per
  shape; a failure is reported with its reason instead of a row of numbers);
* decode: tokens/s of ``model.generate`` (greedy, dynamic cache) of ``new_tokens`` after a
  ``prompt``-token prompt, "multihead" against "sdpa", interleaved, and whether the tokens are identical.

Ratios are against "sdpa" measured in the same run: ``speed`` = sdpa seconds / impl seconds (> 1: faster),
``memory`` = impl peak / sdpa peak (< 1: less). The tables are :mod:`multihead.bench.hf_tables`.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import timing
from .hf_tables import tables, to_json
from .hf_worker import D_MODEL, FLOOR, HEADS, LAYERS, VOCAB, WARM, WINDOW, build_model

__all__ = [
    "D_MODEL",
    "FLOOR",
    "HEADS",
    "IMPLS",
    "LAYERS",
    "VOCAB",
    "WARM",
    "WINDOW",
    "build_model",
    "run",
    "tables",
    "to_json",
]

IMPLS = ("multihead", "sdpa", "eager", "flex_attention")


class _Worker:
    """A worker process for one implementation; ``ask(req)`` sends a request and waits for the answer."""

    def __init__(self, impl: str, max_len: int, threads: int):
        self.impl = impl
        self.err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the worker
        cmd = [
            sys.executable,
            "-m",
            "multihead.bench.hf_worker",
            "--worker",
            impl,
            str(max_len),
            str(threads),
        ]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True, bufsize=1
        )

    def ask(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if line:
            return dict(json.loads(line))
        self.proc.wait()
        self.err.seek(0)
        tail = [t for t in self.err.read().strip().splitlines() if t.strip()]
        last = tail[-1] if tail else "no output"
        return {"error": f"worker exited with code {self.proc.returncode}: {last}"}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


# -- the measurement --------------------------------------------------------------------------------
def _check_lengths(lengths: Sequence[int]) -> list[int]:
    out = []
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"lengths must be positive token counts, got {n!r} in {list(lengths)!r}")
        out.append(n)
    if not out:
        raise ValueError("lengths must name at least one prefill length, got an empty list")
    return out


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _enough(runs: dict[str, list[dict[str, Any]]], skip: dict[str, str], repeats: int) -> bool:
    """Whether every implementation still running has samples enough (:func:`timing.enough`: at least
    ``repeats``, adding up to 0.2 s)."""
    return all(
        timing.enough([x["seconds"] for x in xs], min_samples=repeats)
        for i, xs in runs.items()
        if i not in skip
    )


def run(
    lengths: Sequence[int] = (4096, 8192, 16384),
    *,
    repeats: int = 3,
    new_tokens: int = 64,
    prompt: int = 512,
    impls: Sequence[str] = IMPLS,
    eager_cap: int = 8192,
    threads: int = 1,
    floor: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure prefill at every length and decode, each implementation in its own worker process.

    Args:
        lengths: prefill lengths N (tokens).
        repeats: timed rounds at least, more while an implementation's add up to under 0.2 s
            (:func:`multihead.bench.timing.enough`); in each round every implementation runs once
            (interleaved), timed in its worker by :func:`multihead.bench.timing.first_call`.
        new_tokens: tokens ``generate`` produces in the decode rows (0 skips decode).
        prompt: the decode prompt's length.
        impls: implementations to compare; "sdpa" (the reference of every ratio) is always added.
        eager_cap: "eager" is skipped above this many tokens (its (1, 8, N, N) fp32 scores per layer).
        threads: torch intra-op threads in every worker (1 on a shared machine).
        floor: also a "floor" row: the model with an attention that computes nothing (its output buffer
            only), whose peak is what the rest of the model holds - no implementation can go below it.
        progress: called with a short description before each measurement.

    Returns:
        ``{"setup": {...}, "prefill": [row, ...], "decode": {...} | None}``; a prefill row is
        ``{"n", "impl", "seconds", "seconds_spread", "all_seconds", "speed_vs_sdpa",
        "speed_within_noise", "peak_mib", "memory_vs_sdpa", "max_abs_diff", "calls" (through
        multihead's attention function in one forward), "note"}`` (numbers None and ``note`` the
        reason - an error, "too short to measure" - when it did not run); decode rows likewise have
        "vs_sdpa_within_noise".

    Raises:
        ValueError: for a non-positive length, repeats, prompt or thread count, negative new_tokens, or
            an unknown implementation.
        ImportError: when transformers is not installed.
    """
    import transformers

    ns = _check_lengths(lengths)
    for name, value, least in (("repeats", repeats, 1), ("prompt", prompt, 1), ("threads", threads, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 0:
        raise ValueError(f"new_tokens must be an integer >= 0 (0 skips decode), got {new_tokens!r}")
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise ValueError(f"impls {unknown!r} unknown; choose from {list(IMPLS)}")
    names = ["sdpa"] + [i for i in IMPLS if i in impls and i != "sdpa"] + ([FLOOR] if floor else [])
    say = progress or (lambda what: None)
    max_len = max([*ns, prompt + new_tokens])
    workers = {i: _Worker(i, max_len, threads) for i in names}
    tmp = tempfile.mkdtemp(prefix="mh-bench-hf-")
    rows: list[dict[str, Any]] = []
    decode: dict[str, Any] | None = None
    try:
        for n in ns:
            runs: dict[str, list[dict[str, Any]]] = {i: [] for i in names}
            skip: dict[str, str] = {}
            if "eager" in names and n > eager_cap:
                gib = HEADS * n * n * 4 / 2**30
                skip["eager"] = (
                    f"skipped: N > {eager_cap} (eager holds a few (1, {HEADS}, N, N) fp32 tensors per layer, "
                    f"{gib:.0f} GiB each at this N); raise --eager-cap to run it"
                )
            r = 0
            while r < repeats or not _enough(runs, skip, repeats):
                r += 1
                for impl in names:
                    if impl in skip:
                        continue
                    say(f"prefill N={n} {impl} (round {r}, at least {repeats})")
                    save = os.path.join(tmp, f"{impl}-{n}.pt") if r == 1 and impl != FLOOR else None
                    res = workers[impl].ask({"op": "prefill", "n": n, "save": save})
                    if "error" in res or res["seconds"] is None:
                        skip[impl] = res.get("error") or res["why"]
                    else:
                        runs[impl].append(res)
            rows += _prefill_rows(n, names, runs, skip, tmp)
        if new_tokens:
            decode = _decode(workers, prompt, new_tokens, repeats, say)
    finally:
        for w in workers.values():
            w.close()
        for f in os.listdir(tmp):
            os.remove(os.path.join(tmp, f))
        os.rmdir(tmp)
    setup = {
        "model": f"MistralConfig: {LAYERS} layers, d={D_MODEL}, {HEADS} heads, sliding window {WINDOW}, "
        "random weights, fp32, batch 1",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": threads,
        "repeats": repeats,
        "lengths": ns,
        "eager_cap": eager_cap,
    }
    return {"setup": setup, "prefill": rows, "decode": decode}


def _prefill_rows(
    n: int, names: list[str], runs: dict[str, list[dict[str, Any]]], skip: dict[str, str], tmp: str
) -> list[dict[str, Any]]:
    """One row per implementation at length n, with ratios against sdpa's medians."""
    ref_path = os.path.join(tmp, f"sdpa-{n}.pt")
    ref = torch.load(ref_path) if os.path.exists(ref_path) else None
    base = timing.from_samples([x["seconds"] for x in runs["sdpa"]])
    peaks = {i: [x["peak_bytes"] / 2**20 for x in runs[i] if x["peak_bytes"] is not None] for i in names}
    base_m = _med(peaks["sdpa"])
    rows = []
    for impl in sorted(names, key=(*IMPLS, FLOOR).index):
        secs = [x["seconds"] for x in runs[impl]]
        t, peak = timing.from_samples(secs), _med(peaks[impl])
        speed = timing.compare(base, t)  # sdpa's time / this one's: > 1 faster
        diff = None
        path = os.path.join(tmp, f"{impl}-{n}.pt")
        if ref is not None and os.path.exists(path):
            out = torch.load(path)
            diff = float((out - ref).abs().max())
            del out
            if impl != "sdpa":
                os.remove(path)
        note = skip.get(impl)
        if impl == FLOOR and note is None:
            note = "attention computes nothing: the peak of the rest of the model"
        if note is None and runs[impl] and not all(x["finite"] for x in runs[impl]):
            note = "output not finite"
        rows.append(
            {
                "n": n,
                "impl": impl,
                "seconds": t.median,
                "seconds_spread": [t.low, t.high],
                "all_seconds": secs,
                "speed_vs_sdpa": speed.ratio,
                "speed_within_noise": speed.same,
                "peak_mib": peak,
                "memory_vs_sdpa": peak / base_m if peak is not None and base_m else None,
                "max_abs_diff": diff,
                "calls": runs[impl][0]["calls"] if runs[impl] else 0,
                "note": note,
            }
        )
    if os.path.exists(ref_path):
        os.remove(ref_path)
    return rows


def _decode(
    workers: dict[str, _Worker], prompt: int, new: int, repeats: int, say: Callable[[str], None]
) -> dict[str, Any]:
    """Interleaved ``generate`` rounds, multihead against sdpa, at least ``repeats`` of them and more
    while the samples add up to under 0.2 s (:func:`timing.enough`)."""
    impls = [i for i in ("multihead", "sdpa") if i in workers]
    runs: dict[str, list[dict[str, Any]]] = {i: [] for i in impls}
    errors: dict[str, str] = {}
    r = 0
    while r < repeats or not _enough(runs, errors, repeats):
        r += 1
        for impl in impls:
            if impl in errors:
                continue
            say(f"decode {new} tokens {impl} (round {r}, at least {repeats})")
            res = workers[impl].ask({"op": "decode", "prompt": prompt, "new": new})
            if "error" in res or res["seconds"] is None:
                errors[impl] = res.get("error") or res["why"]
            else:
                runs[impl].append(res)
    times = {i: timing.from_samples([x["seconds"] for x in runs[i]]) for i in impls}
    rows = []
    for impl in impls:
        vs = timing.compare(times["sdpa"], times[impl]) if "sdpa" in times else timing.Comparison(None, False)
        rows.append(
            {
                "impl": impl,
                "tok_s": times[impl].rate(new),
                "all_tok_s": [new / x["seconds"] for x in runs[impl]],
                "vs_sdpa": vs.ratio,  # sdpa's time / this one's: this one's rate / sdpa's
                "vs_sdpa_within_noise": vs.same,
                "calls": runs[impl][0]["calls"] if runs[impl] else 0,
                "note": errors.get(impl),
            }
        )
    seqs = [tuple(x["tokens"]) for i in impls for x in runs[i]]
    return {"prompt": prompt, "new_tokens": new, "rows": rows, "tokens_identical": len(set(seqs)) == 1}
