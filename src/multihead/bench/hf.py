"""``multihead bench hf``: multihead as a Hugging Face attention backend against transformers' own.

A Mistral-shaped model (transformers ``MistralConfig``: 2 layers, d=512, 8 heads, sliding window 1024,
random weights, fp32, batch 1) built offline, once per attention implementation, each in its own worker
process (``python -m multihead.bench.hf --worker IMPL``), so that one implementation's peak memory never
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
``memory`` = impl peak / sdpa peak (< 1: less).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import torch

from . import timing

__all__ = ["FLOOR", "IMPLS", "WINDOW", "build_model", "run", "tables", "to_json"]

IMPLS = ("multihead", "sdpa", "eager", "flex_attention")
FLOOR = "floor"  # an attention that computes nothing: the model's own activations, the floor of any impl
WINDOW = 1024
VOCAB = 1024
LAYERS, D_MODEL, HEADS = 2, 512, 8
WARM = 256  # tokens of the warm-up prefill each worker runs before its first measurement


def build_model(max_len: int) -> Any:
    """The benchmark's Mistral-shaped random-weight causal LM (attn_implementation "sdpa"; switch it with
    ``model.set_attn_implementation``), with multihead registered as "multihead".

    Raises:
        ImportError: when transformers is not installed.
    """
    import transformers

    from ..hf import register

    register()
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=1408,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        sliding_window=WINDOW,
        max_position_embeddings=max_len,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _ids(n: int, seed: int, low: int = 0) -> torch.Tensor:
    return torch.randint(low, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))  # (1, n)


# -- the worker: one implementation, one loaded model, requests as JSON lines -------------------------
def _worker(impl: str, max_len: int, threads: int) -> None:
    """Serve ``{"op": "prefill" | "decode", ...}`` requests on stdin, one JSON answer per line on the real
    stdout (anything else the libraries print goes to stderr)."""
    from .approx import peak_rss_tracker

    answer: TextIO = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # library chatter on fd 1 must not corrupt the answers
    torch.set_num_threads(threads)
    model = build_model(max_len)
    if impl == FLOOR:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        from ..hf import mask_interface

        AttentionInterface.register(FLOOR, _no_attention)
        AttentionMaskInterface.register(FLOOR, mask_interface)
    model.set_attn_implementation(impl)
    from ..hf import register

    counter = register()  # the function "multihead" runs: its calls prove our backend ran
    warmed: set[int] = set()  # prefill lengths warmed up
    decode_warm = False
    for line in sys.stdin:
        req = json.loads(line)
        try:
            with torch.no_grad():
                if req["op"] == "prefill":
                    n = int(req["n"])
                    warm = n if impl == "flex_attention" else WARM  # flex compiles per shape
                    if warm not in warmed:
                        model.model(input_ids=_ids(min(warm, n), 3), use_cache=False)
                        warmed.add(warm)
                    ids = _ids(n, 1)
                    gc.collect()
                    extra = peak_rss_tracker()
                    forward = _counted(counter, functools.partial(_hidden, model, ids))  # (1, n, d)
                    h, t = timing.first_call(forward)
                    peak = None if extra is None else extra()
                    if req.get("save"):
                        torch.save(h, req["save"])
                    res: dict[str, Any] = {
                        "seconds": t.median,
                        "why": t.why,
                        "peak_bytes": peak,
                        "finite": bool(torch.isfinite(h).all()),
                        "calls": forward.first_calls,  # type: ignore[attr-defined]
                    }
                    del h
                else:
                    prompt, new = int(req["prompt"]), int(req["new"])
                    if not decode_warm:
                        _generate(model, _ids(16, 2, low=1), 4)
                        decode_warm = True
                    gen = _counted(counter, functools.partial(_generate, model, _ids(prompt, 2, low=1), new))
                    tokens, t = timing.first_call(gen)
                    res = {
                        "seconds": t.median,
                        "why": t.why,
                        "tokens": tokens,
                        "calls": gen.first_calls,  # type: ignore[attr-defined]
                    }
        except Exception as e:  # reported in the table: flex refusing CPU shapes, out of memory, ...
            res = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e) else ''}"}
        answer.write(json.dumps(res) + "\n")
        answer.flush()


def _hidden(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The last hidden state (1, n, d) of a prefill of ``ids`` (1, n), without a cache."""
    return model.model(input_ids=ids, use_cache=False).last_hidden_state  # (1, n, d)


def _counted(counter: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` that keeps, as ``first_calls``, how many calls ``counter`` (our attention function) saw
    during its first call: :func:`timing.first_call` may call it again where one call is too short."""

    def call() -> Any:
        before = counter.calls
        out = fn()
        if not hasattr(call, "first_calls"):
            call.first_calls = counter.calls - before  # type: ignore[attr-defined]
        return out

    return call


def _no_attention(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *a: Any, **kw: Any
) -> tuple[torch.Tensor, None]:
    """The floor row's attention: only the (B, Sq, Hq, Dv) output buffer every implementation returns."""
    B, H, S, _ = query.shape
    return query.new_zeros(B, S, H, value.shape[-1]), None  # (B, Sq, Hq, Dv)


def _generate(model: Any, prompt: torch.Tensor, new: int) -> list[int]:
    """The tokens of a greedy ``generate`` of exactly ``new`` tokens after ``prompt`` (1, P). Token 0 is
    the pad id handed to generate, so prompts draw from 1..VOCAB-1."""
    out = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )  # (1, P + new)
    return list(out[0, prompt.shape[1] :].tolist())


class _Worker:
    """A worker process for one implementation; ``ask(req)`` sends a request and waits for the answer."""

    def __init__(self, impl: str, max_len: int, threads: int):
        self.impl = impl
        self.err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - lives as long as the worker
        cmd = [sys.executable, "-m", "multihead.bench.hf", "--worker", impl, str(max_len), str(threads)]
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


# -- output -----------------------------------------------------------------------------------------
def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _vs(row: dict[str, Any], key: str, same: str) -> str:
    """A ratio against sdpa: "1.23x", or "same within noise" where the spreads overlap (never a gain)."""
    if row["impl"] != "sdpa" and row.get(same) and row[key] is not None:
        return timing.SAME
    return _num(row[key], ".2f") + "x"


def tables(doc: dict[str, Any]) -> list[Any]:
    """The prefill table and the decode table as ``rich`` tables (a note under a row that did not run)."""
    from rich.table import Table

    s = doc["setup"]
    pre = Table(
        title="prefill: multihead inside a Hugging Face model vs transformers' own attention",
        caption=f"{s['model']}; torch {s['torch']}, transformers {s['transformers']}, {s['threads']} "
        f"thread(s), median of >= {s['repeats']} interleaved rounds (more while under 0.2 s), "
        "peak = resident set above the loaded model",
    )
    for col in ("N", "impl", "prefill s", "speed vs sdpa", "peak extra MiB", "memory vs sdpa", "max |diff|"):
        pre.add_column(col, justify="left" if col == "impl" else "right")
    for r in doc["prefill"]:
        if r["seconds"] is None:
            pre.add_row(str(r["n"]), r["impl"], r["note"] or "did not run", "", "", "", "")
            continue
        pre.add_row(
            str(r["n"]),
            "floor (no attention)" if r["impl"] == FLOOR else r["impl"],
            _seconds(r),
            _vs(r, "speed_vs_sdpa", "speed_within_noise"),
            _num(r["peak_mib"], ".0f"),
            _num(r["memory_vs_sdpa"], ".2f"),
            _num(r["max_abs_diff"], ".1e"),
        )
    out = [pre]
    d = doc["decode"]
    if d is not None:
        dec = Table(
            title=f"decode: generate {d['new_tokens']} tokens after a {d['prompt']}-token prompt",
            caption=f"greedy, dynamic cache; tokens identical: {'yes' if d['tokens_identical'] else 'NO'}",
        )
        for col in ("impl", "tok/s", "vs sdpa", "runs tok/s"):
            dec.add_column(col, justify="left" if col == "impl" else "right")
        for r in d["rows"]:
            runs = " ".join(f"{x:.1f}" for x in r["all_tok_s"])
            if r["tok_s"] is None:
                dec.add_row(r["impl"], r["note"] or "did not run", "", "")
            else:
                dec.add_row(
                    r["impl"], _num(r["tok_s"], ".1f"), _vs(r, "vs_sdpa", "vs_sdpa_within_noise"), runs
                )
        out.append(dec)
    return out


def _seconds(r: dict[str, Any]) -> str:
    """A prefill's seconds, checked (:func:`multihead.bench.timing.check_figure`): "n/a (why; what to
    pass)" for a spread wider than 10x."""
    low, high = r.get("seconds_spread") or (None, None)
    fix = "pass a larger `multihead bench hf --repeats`, or run on an idle machine"
    return timing.check_figure(r["seconds"], low, high, fix=fix).text(".3f")


def to_json(doc: dict[str, Any]) -> str:
    """The results as indented JSON."""
    return json.dumps(doc, indent=1)


def _main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="worker of multihead bench hf (not for direct use)")
    ap.add_argument("--worker", nargs=3, metavar=("IMPL", "MAX_LEN", "THREADS"), required=True)
    args = ap.parse_args(argv)
    impl, max_len, threads = args.worker
    _worker(impl, int(max_len), int(threads))


if __name__ == "__main__":
    _main()
