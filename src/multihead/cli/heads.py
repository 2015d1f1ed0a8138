"""``multihead heads``: what the 72 heads of the bundled all-MiniLM-L6-v2 look at.

    multihead heads                                  the default sentence; roles over 32 docstrings
    multihead heads "Some text to look at." --out multihead-heads/
    multihead heads --texts 0 --head 0.2 --head 1.11 --json

Writes to ``--out`` (default ``multihead-heads/``): ``maps.png`` (the layer x head grid of the text's
attention maps), ``roles.png`` and ``roles.md`` (each head's role and Clark et al.'s statistics,
measured on the text and ``--texts`` standard-library docstrings) and ``head_L_H.png`` per ``--head L.H``
(one map with its tokens). Prints the role grid (or, with ``--json``, the table and the files).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["DEFAULT_TEXT", "register", "run"]

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away."


def _head_arg(text: str) -> tuple[int, int]:
    layer, sep, head = text.partition(".")
    if not sep or not layer.isdigit() or not head.isdigit():
        raise argparse.ArgumentTypeError(f"expected LAYER.HEAD such as 0.2, got {text!r}")
    return int(layer), int(head)


def run(args: argparse.Namespace) -> int:
    """Measure the roles, draw the maps, write the files; return 0.

    Raises:
        ValueError: a --head outside the model, a negative --texts, and what the head tools raise.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .. import heads
    from ..heads import plots
    from ..pretrained import minilm, stdlib_docstrings

    if args.texts < 0:
        raise ValueError(f"--texts must be >= 0, got {args.texts}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("loading all-MiniLM-L6-v2", total=4)
        model = minilm()
        attns = [layer.self_attn for layer in heads.layers_of(model)]
        L, H = len(attns), attns[0].n_heads
        for layer, head in args.head:
            if not (0 <= layer < L and 0 <= head < H):
                raise ValueError(f"--head {layer}.{head} is outside the model's {L} layers x {H} heads")
        texts = [args.text, *(stdlib_docstrings(args.texts, max_chars=600) if args.texts else [])]
        bar.update(task, advance=1, description=f"attention maps of {len(texts)} texts")
        maps = heads.attention_maps(model, texts)
        tokens = heads.token_strings(model, texts)
        table = heads.roles(maps, tokens)
        bar.update(task, advance=1, description="drawing")
        files = [
            plots.plot_maps(maps[0], out / "maps.png", table, title=args.text[:100]),
            plots.plot_roles(table, out / "roles.png"),
        ]
        for layer, head in args.head:
            name = out / f"head_{layer}_{head}.png"
            title = f"layer {layer} head {head}"
            files.append(plots.plot_head(maps[0][layer, head], tokens[0], name, title=title))
        bar.update(task, advance=1)
        md = out / "roles.md"
        where = f"the text and {args.texts} docstrings" if args.texts else "the text"
        md.write_text(
            f"# Head roles of all-MiniLM-L6-v2 on {where}\n\n{heads.roles_grid(table)}\n\n"
            f"{heads.roles_table(table)}\n"
        )
        files.append(md)
    if args.json:
        doc = {"text": args.text, "texts": len(texts), "roles": [r.as_dict() for r in table]}
        print(json.dumps({**doc, "files": [str(f) for f in files]}, indent=1))
        return 0
    from .console import make_console

    console = make_console()
    console.print(f"head roles on {where} ({sum(len(t) for t in tokens)} tokens):", markup=False)
    console.print(heads.roles_grid(table), markup=False)
    for f in files:
        console.print(f"wrote {f}", markup=False)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``heads`` subcommand to the ``multihead`` parser."""
    p = sub.add_parser(
        "heads",
        help="what each head of all-MiniLM-L6-v2 attends to: map grid and role table (PNG, markdown)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("text", nargs="?", default=DEFAULT_TEXT, help="the text whose maps are drawn")
    p.add_argument(
        "--texts",
        type=int,
        default=32,
        help="standard-library docstrings added to the role statistics; 0: the text only (default 32)",
    )
    p.add_argument(
        "--out",
        default="multihead-heads",
        help="directory for the PNGs and roles.md (default multihead-heads/)",
    )
    p.add_argument(
        "--head",
        type=_head_arg,
        action="append",
        default=[],
        metavar="L.H",
        help="also draw head H of layer L with its tokens (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the role table and the files as JSON")
    p.set_defaults(func=run)
