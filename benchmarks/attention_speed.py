"""The attention speed suite as markdown tables for BENCHMARKS.md (the numbers come from ``multihead bench``).

python benchmarks/attention_speed.py                  # the quick suite, run now
python benchmarks/attention_speed.py --full           # the whole fixed suite (tens of minutes)
multihead bench --full --json > bench.json && python benchmarks/attention_speed.py --from bench.json
python benchmarks/attention_speed.py --from a.json b.json --plot speed.png   # one table each, one plot
"""

from __future__ import annotations

import argparse
import json

from multihead.bench import suite as bench
from multihead.bench import timing


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['threads']} threads, torch {m['torch']}; measured in the same run: "
        f"matmul {m['matmul_gflops']} GFLOP/s, memory bandwidth {m['bandwidth_gbps']} GB/s.",
        "",
        "| case | N | method | ms (spread) | useful GFLOP/s | % of matmul | GB/s (K/V) | peak extra MiB "
        "| time ratio vs peers |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in doc["results"]:
        method = r["method"] + (f" ({r['note']})" if r["note"] and r["ms"] is not None else "")
        if r["ms"] is None:
            what = timing.TOO_SHORT if timing.TOO_SHORT in r["note"] else "skipped"
            lines.append(f"| {r['case']} | {r['n']} | {method} | {what}: {r['note']} | | | | | |")
            continue
        ours = r["method"] in ("auto", "tiled", "decode")
        vs = bench.vs_text(r) if ours else ""  # a ratio inside the spread reads "same within noise"
        spread = r.get("ms_spread")
        ms = f"{r['ms']:.1f}" + (f" ({spread[0]:.1f}-{spread[1]:.1f})" if spread else "")
        lines.append(
            f"| {r['case']} | {r['n']} | {method} | {ms} | {_f(r['gflops'], '.1f')} | "
            f"{_f(100 * r['matmul_frac'], '.0f')} | {_f(r['gbps'], '.2f')} | {_f(r['peak_mib'], '.0f')} "
            f"| {vs} |"
        )
    lines += ["", "| goal | case | N | measured | met |", "|---|---|---:|---:|---|"]
    for g in doc["goals"]:
        lines.append(
            f"| {g['goal']} | {g['case']} | {g['n']} "
            f"| {timing.SAME if g.get('within_noise') else _f(g['value'], '.3f')} "
            f"| {'yes' if g['met'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="the whole fixed suite")
    ap.add_argument("--only", default=None, help="only cases whose name contains this")
    ap.add_argument(
        "--from", dest="paths", nargs="+", default=None, help="saved `multihead bench --json` files"
    )
    ap.add_argument("--plot", default=None, metavar="PNG", help="also plot time vs N per method (all runs)")
    a = ap.parse_args()
    docs = []
    for path in a.paths or []:
        with open(path) as f:
            docs.append(json.load(f))
    if not docs:
        docs = [bench.run("full" if a.full else "quick", only=a.only)]
    print("\n\n".join(markdown(doc) for doc in docs))
    if a.plot:
        merged = dict(docs[0], results=[r for d in docs for r in d["results"]], goals=[])
        bench.plot(merged, a.plot)
        print(f"\nplot: {a.plot}")


if __name__ == "__main__":
    main()
