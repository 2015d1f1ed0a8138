"""``multihead eval``: human-judged scores of a sentence encoder (Lee, WordSim-353, polarity).

multihead eval                       the bundled all-MiniLM-L6-v2
multihead eval --model DIR           a SentenceEncoder saved in DIR (model.safetensors, tokenizer.json, ...)
                                     or a MiniLM converted by `multihead heads convert --out DIR`
multihead eval --json                the scores and their bootstrap 95% intervals as JSON
multihead eval --perplexity          perplexity of SmolLM2-135M-Instruct on held-out Wikipedia articles
multihead eval --perplexity --model FILE.gguf --context 1024 --stride 512 --texts 16 --chars 0 --json
"""

from __future__ import annotations

import argparse
import json

from .args import count, integer, positive_int, seed
from .models import LM_MODEL
from .threads import threads_option

__all__ = ["register"]

#: held-out articles and characters of each that ``--perplexity`` scores by default (3307 SmolLM2 tokens)
TEXTS, CHARS = 8, 2000


def _perplexity(args: argparse.Namespace) -> int:
    """``--perplexity``: the language model's perplexity on the held-out Wikipedia articles."""
    from ..eval import perplexity_scores
    from ..eval.wikipedia import held_out_texts
    from .console import make_console
    from .models import load_lm
    from .progress import eta_progress

    if args.stride > args.context:
        raise ValueError(f"--stride ({args.stride}) must be at most --context ({args.context})")
    model, tokenizer, name = load_lm(args.model or "smollm2")
    if tokenizer is None:
        raise ValueError(
            f"--model {args.model!r} has no tokenizer.json; perplexity needs the model's tokenizer"
        )
    texts = held_out_texts(args.texts, args.chars or None)
    with eta_progress() as bar:
        task = bar.add_task("scoring windows", total=None)
        s = perplexity_scores(
            model, texts, context=args.context, stride=args.stride, tokenizer=tokenizer,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )  # fmt: skip
    resample = args.bootstrap > 0 and s.tokens.numel() > 1  # one window has no spread to resample
    low, high = s.interval(samples=args.bootstrap, seed=args.seed) if resample else (None, None)
    how = f"percentile bootstrap 95% over windows, {args.bootstrap} resamples" if resample else None
    result = {
        "model": name, "perplexity": s.perplexity, "low": low, "high": high, "tokens": s.scored,
        "windows": int(s.tokens.numel()), "context": args.context, "stride": args.stride,
        "texts": len(texts), "chars": args.chars or None,
        "interval": how,
    }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    ci = "-" if low is None else f"[{low:.3f}, {high:.3f}]"
    make_console().print(
        f"perplexity of {name}: {s.perplexity:.3f} (95% interval {ci}, bootstrap over {result['windows']} "
        f"windows)\n{s.scored} tokens scored: the first {len(texts)} held-out Wikipedia articles"
        + (f" (up to {args.chars} characters each)" if args.chars else "")
        + f", context {args.context}, stride {args.stride}"
    )
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from ..eval import SETS, human_judged
    from ..pretrained import minilm
    from .console import make_console
    from .models import load_encoder

    try:
        if args.perplexity:
            return _perplexity(args)
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
        help="human-judged scores of a sentence encoder (Lee, WordSim-353, polarity); --perplexity: a "
        "language model's perplexity on held-out Wikipedia",
        description="Score a sentence encoder against human judgements: Pearson with the Lee et al. (2005) "
        "document similarities, Spearman with WordSim-353, and 5-fold logistic-probe accuracy on movie-"
        "review polarity, each with a bootstrap 95% interval. With --perplexity: a language model's "
        "perplexity on held-out English Wikipedia articles (transformers' sliding-window method), with a "
        "bootstrap 95% interval over windows. The data ship inside gensim: pip install multihead[eval]. "
        "Default model: the bundled all-MiniLM-L6-v2 (with --perplexity: smollm2).",
    )
    p.add_argument(
        "--model", metavar="M",
        help="a SentenceEncoder directory or a `heads convert` folder of MiniLM (default: all-MiniLM-L6-v2); "
        f"with --perplexity {LM_MODEL} (default smollm2)",
    )  # fmt: skip
    p.add_argument("--perplexity", action="store_true", help="score a language model's perplexity instead")
    p.add_argument(
        "--context", type=integer(2), default=512, help="--perplexity: tokens per window (>= 2, default 512)"
    )
    p.add_argument(
        "--stride", type=positive_int, default=256,
        help="--perplexity: tokens between window starts (1 to --context, default 256)",
    )  # fmt: skip
    p.add_argument(
        "--texts", type=positive_int, default=TEXTS,
        help=f"--perplexity: the first N held-out Wikipedia articles (default {TEXTS})",
    )  # fmt: skip
    p.add_argument(
        "--chars", type=count, default=CHARS,
        help=f"--perplexity: characters of each article, cut at a paragraph (default {CHARS}; 0: whole)",
    )  # fmt: skip
    p.add_argument("--bootstrap", type=count, default=200, help="bootstrap resamples (default 200; 0: none)")
    p.add_argument(
        "--seed", type=seed, default=0, help="probe folds and bootstrap seed (0 to 4294967295, default 0)"
    )
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    p.set_defaults(func=_cmd_eval)
    threads_option(p)
