"""``multihead bench``: the attention speed suite (ours against SDPA, SDPA per block and eager, as ratios
in one run), or ``--distributed N`` for ring attention on local processes. Whole-model benchmarks are
subcommands, one file each: ``multihead bench <name> --help``."""

from __future__ import annotations

import argparse

from ..bench import suite
from . import bench_decode, bench_hf
from .args import integer, positive_int
from .console import check_output_file, for_terminal, writing
from .threads import threads_option

__all__ = ["MAX_PROCESSES", "register"]

#: the most local processes ``--distributed`` starts
MAX_PROCESSES = 64


def register(sub) -> None:
    """Register ``multihead bench`` on the CLI's subparsers."""
    p = sub.add_parser(
        "bench",
        help="attention speed suite: ours against SDPA, SDPA per block, eager (and flex), as ratios",
        description=for_terminal(suite.__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--full",
        dest="kind",
        action="store_const",
        const="full",
        help="the whole fixed suite (tens of minutes)",
    )
    size.add_argument(
        "--tiny", dest="kind", action="store_const", const="tiny", help="a seconds-long smoke run"
    )
    p.set_defaults(kind="quick", func=_cmd_bench)
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per method (default 3)")
    p.add_argument(
        "--only", metavar="NAME", default=None,
        help="run only this case family or the cases whose name contains NAME (NAME,NAME,... for several)",
    )  # fmt: skip
    p.add_argument("--flex", action="store_true", help="also compiled FlexAttention (compiles per shape)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    p.add_argument("--plot", metavar="PATH", default=None, help="save time vs N per method as a PNG")
    p.add_argument(
        "--distributed",
        metavar="N",
        type=integer(1, MAX_PROCESSES, unit="processes"),
        default=None,
        help=f"instead: ring attention on 1, 2, 4, ... N local gloo processes, N at most {MAX_PROCESSES} "
        "(per-rank memory, time, bytes)",
    )
    p.add_argument("--seq", type=positive_int, default=8192, help="with --distributed: the global length")
    threads_option(p)
    # Whole-model benchmarks (``multihead bench NAME``): each cli/bench_NAME.py registers itself here.
    whole = p.add_subparsers(dest="what", metavar="NAME", title="whole-model benchmarks")
    bench_decode.register(whole)
    bench_hf.register(whole)


def _cmd_bench(args) -> int:
    """Run the suite with a progress bar; print the tables (or JSON); save the plot."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(highlight=False, stderr=args.json)
    if not console.is_terminal:
        console.width = 180
    if args.plot:
        _check_plot(args.plot)
    if args.distributed is not None:
        return _cmd_distributed(args, console)
    n = len([c for c in suite.cases(args.kind) if suite.selected(c, args.only)])
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("bench", total=n)

        def step(what: str) -> None:
            bar.update(task, advance=0 if bar.tasks[0].description == "bench" else 1, description=what)

        doc = suite.run(args.kind, repeats=args.repeats, flex=args.flex, only=args.only, progress=step)
    if args.json:
        print(suite.to_json(doc))
    else:  # the tables first: nothing after them can lose them
        console.print(suite.table(doc))
        if doc["goals"]:  # the small runs measure no case a goal is set on
            console.print(suite.goals_table(doc))
    if args.plot:
        with writing(args.plot, "--plot"):
            suite.plot(doc, args.plot)
        Console(highlight=False, stderr=True).print(f"wrote {args.plot}", markup=False)
    return 0


def _check_plot(path: str) -> None:
    """Fail before the work when --plot cannot be drawn or written.

    Raises:
        ValueError: matplotlib missing, or a path that cannot be written.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    check_output_file(path, "--plot")


def _cmd_distributed(args, console) -> int:
    """``multihead bench --distributed N``: ring attention scaling over local gloo process groups."""
    from ..bench.distributed import render_distributed_bench, run_distributed_bench, world_sizes_up_to

    sizes = world_sizes_up_to(args.distributed)
    with console.status("ring attention on local gloo processes") as status:
        doc = run_distributed_bench(sizes, args.seq, progress=lambda what: status.update(what))
    if args.json:
        print(suite.to_json(doc))
        return 0
    console.print(render_distributed_bench(doc))
    return 0
