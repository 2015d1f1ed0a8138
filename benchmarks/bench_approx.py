"""Approximations and int8 quantization: quality against time and memory (BENCHMARKS.md, "Approximations").

    python benchmarks/bench_approx.py                      # cost at N = 1K/4K/16K + MiniLM fidelity
    python benchmarks/bench_approx.py --mqar-steps 2000    # + MQAR accuracy of every method (slow)
    python benchmarks/bench_approx.py --mqar-from DIR      # + MQAR results saved by `multihead train --json`
    python benchmarks/bench_approx.py --from OUT/approx.json --mqar-from DIR   # re-render a saved run
    python benchmarks/bench_approx.py --quant              # int8 weights on the 155M LLaMA-shaped model
    python benchmarks/bench_approx.py --out DIR            # DIR/approx.json, DIR/pareto.png

Each (method, N) cost runs in a fresh subprocess: the peak memory is the growth of that process's peak
resident set (VmHWM) over its inputs, with nothing else in the process. Run it niced on a shared box
(``nice -n 10``); with other jobs on the cores, ``OMP_WAIT_POLICY=PASSIVE`` keeps OpenMP from spinning.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _child(name: str, n: int) -> None:
    from multihead.bench import approx as measure

    approx = measure.make(name, n)
    print(json.dumps(measure.cost(approx, n)))


def _costs(names: list[str], ns: list[int]) -> dict[str, dict[int, dict]]:
    from multihead.bench import approx as measure

    limits = {m.name: m.max_n for m in measure.METHODS}
    out: dict[str, dict[int, dict]] = {name: {} for name in names}
    for name in names:
        for n in ns:
            if limits[name] is not None and n > limits[name]:
                continue
            cmd = [sys.executable, __file__, "--child", name, str(n)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            out[name][n] = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"  {name} N={n}: {out[name][n]}", file=sys.stderr)
    return out


def _quant(prompt: int = 256, new: int = 32, repeats: int = 5) -> dict:
    """fp32 vs int8 on the llama-155m preset: bytes, prefill seconds, decode tokens/s, logit agreement."""
    import torch

    from multihead import pretrained
    from multihead.models import quant

    fp32 = pretrained.random_lm("llama-155m", seed=0).eval()
    ids = torch.randint(0, fp32.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    models = {
        "fp32": fp32,
        "int8 weights, fbgemm (int8 activations)": quant.quantize(fp32, kv=None),
        "int8 weights (fbgemm) + int8 K/V": quant.quantize(fp32),
    }
    rows: dict[str, dict] = {}
    with torch.inference_mode():
        ref = fp32(ids)[0]  # (N, V)
        times = timed(models, ids, new, repeats)
        for name, model in models.items():
            pre, dec = times[name]
            out = model(ids)[0]
            rows[name] = {
                "bytes": quant.model_bytes(model),
                "prefill_s": pre.median,  # None: too short to measure
                "decode_tok_s": dec.rate(new - 1),  # the first new token comes from the prefill
                "decode_why": dec.why,
                "logit_rms_rel": float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()),
                "argmax_agree": float((out.argmax(-1) == ref.argmax(-1)).float().mean()),
            }
            print(f"  {name}: {rows[name]}", file=sys.stderr)
    params = sum(p.numel() for p in fp32.parameters())
    return {
        "model": "llama-155m (random weights)",
        "params": params,
        "prompt": prompt,
        "new": new,
        "rows": rows,
    }


def timed(models: dict, ids, new: int, repeats: int, clock=time.perf_counter) -> dict:
    """name -> (prefill Timing, decode Timing): ``model(ids)`` and ``model.generate(ids, new)`` of every
    model interleaved (:func:`multihead.bench.timing.measure_all`, at least ``repeats`` samples each),
    so load changes on a shared box hit every model alike; the decode steps are generate minus prefill
    (:func:`multihead.bench.timing.difference`: "too short to measure" inside the noise)."""
    from multihead.bench import timing

    calls = {}
    for name, model in models.items():
        calls[f"{name}|prefill"] = lambda m=model: m(ids)
        calls[f"{name}|generate"] = lambda m=model: m.generate(ids, new)
    t = timing.measure_all(calls, min_samples=repeats, clock=clock)
    return {
        name: (t[f"{name}|prefill"], timing.difference(t[f"{name}|generate"], t[f"{name}|prefill"]))
        for name in models
    }


def _mqar_from(folder: Path, rows: list[dict]) -> None:
    """Fill ``mqar_acc`` from saved ``multihead train --attention NAME --json`` results: the file
    ``approx_<NAME>.json`` (NAME as on the command line: TopK, local, ...) or ``exact.json``."""
    for r in rows:
        short = "exact" if r["name"].startswith("exact") else r["name"].split("(")[0]
        path = folder / ("exact.json" if short == "exact" else f"approx_{short}.json")
        if path.exists() and path.stat().st_size:
            res = json.loads(path.read_text())
            r.update(
                {"mqar_acc": res["accuracy"], "mqar_causal": res["causal"], "mqar_seconds": res["seconds"]}
            )


def main() -> None:
    from multihead.pretrained.files import atomic_write

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="*", default=[1024, 4096, 16384])
    ap.add_argument("--texts", type=int, default=256, help="docstrings for MiniLM fidelity (0: skip)")
    ap.add_argument("--mqar-steps", type=int, default=0, help="train each method on MQAR for this many steps")
    ap.add_argument(
        "--mqar-from", default=None, metavar="DIR",
        help="MQAR column from DIR/approx_NAME.json and DIR/exact.json (`multihead train --json` outputs)",
    )  # fmt: skip
    ap.add_argument(
        "--from", dest="saved", default=None, metavar="JSON", help="re-render a saved approx.json"
    )
    ap.add_argument("--only", nargs="*", default=None, help="method names (default: all)")
    ap.add_argument("--quant", action="store_true", help="only the int8 benchmark on llama-155m")
    ap.add_argument("--out", default="bench_out", help="directory for approx.json and pareto.png")
    ap.add_argument("--child", nargs=2, metavar=("NAME", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.child[0], int(a.child[1]))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.quant:
        res = _quant()
        with atomic_write(out / "quant.json") as tmp:
            tmp.write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
        return
    from multihead.bench import approx as measure
    from multihead.study.sections import approximations as report
    from multihead.train.trainer import TrainConfig

    if a.saved:  # a saved run: costs and fidelity as measured then, the MQAR column from --mqar-from
        saved = json.loads(Path(a.saved).read_text())
        a.n = saved["ns"]
        rows = [{**r, "cost": {int(k): v for k, v in r["cost"].items()}} for r in saved["rows"]]
        quality = {"rows": rows, "notes": saved["notes"]}
    else:
        names = a.only or [m.name for m in measure.METHODS]
        mqar = TrainConfig(steps=a.mqar_steps) if a.mqar_steps else None
        say = lambda what, done: print(f"  {what}", file=sys.stderr)  # noqa: E731
        quality = report.compare(names, (), a.texts, mqar, say)
        costs = _costs(names, a.n)
        rows = [{**r, "cost": costs[r["name"]]} for r in quality["rows"]]
    if a.mqar_from:
        _mqar_from(Path(a.mqar_from), rows)
        extra = report.mqar_notes(rows)
        quality["notes"] = [n for n in quality["notes"] if n not in extra] + extra
    png = measure.pareto_png(rows, out / "pareto.png", max(a.n))
    doc = {"ns": a.n, "rows": [{**r, "cost": {str(k): v for k, v in r["cost"].items()}} for r in rows]}
    with atomic_write(out / "approx.json") as tmp:
        tmp.write_text(json.dumps({**doc, "notes": quality["notes"], "png": png}, indent=1))
    print(report.table(rows, tuple(a.n)).markdown())
    for note in quality["notes"]:
        print(note)


if __name__ == "__main__":
    main()
