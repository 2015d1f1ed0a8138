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
from multihead.bench.suite_markdown import markdown


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
