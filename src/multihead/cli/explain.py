"""``multihead explain``: what one attention problem or one whole model costs, and why.

Two modes::

    multihead explain [--seq N] [--batch B] [--heads H] [--kv-heads H] [--head-dim D] [--mask M]
        one attention problem: which backend ``auto`` picks and why, its mask, one layer's walk
    multihead explain --preset NAME | --hf DIR [--seq N] [--batch B] [--phase P] [--cached N]
                      [--roof measure|GFLOPS:GBPS] [--plot PNG]
        a whole model (a preset shape, or the config.json of a Hugging Face directory; no weights are
        read or allocated): its shape walk, the cost table of :func:`multihead.cost.estimate`, memory,
        the mask pictures and - with ``--roof`` - each op placed on the roofline

Both take ``--phase prefill|decode``, ``--dtype`` and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch

from .. import cost
from ..backends.auto import choose, explain
from ..core.masks import Mask, causal, prefix_lm, sliding_window
from ..core.problem import make_problem
from ..study.context import walk_table

__all__ = ["DTYPES", "parse_mask", "register"]

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
PICTURE_MAX = 16  # the mask picture shows at most this many query rows and key columns
_PROBLEM_FLAGS = {"heads": "--heads", "kv_heads": "--kv-heads", "head_dim": "--head-dim", "mask": "--mask"}


def parse_mask(spec: str) -> Mask | None:
    """``"none"`` -> None, ``"causal"``, ``"sliding:W"`` -> sliding_window(W), ``"prefix:N"`` -> prefix_lm(N).

    Raises:
        ValueError: on any other spec or a bad number.
    """
    name, _, arg = spec.partition(":")
    if name == "none" and not arg:
        return None
    if name == "causal" and not arg:
        return causal()
    if name in ("sliding", "prefix") and arg.lstrip("-").isdigit():
        return sliding_window(int(arg)) if name == "sliding" else prefix_lm(int(arg))
    raise ValueError(f"unknown mask {spec!r}; use causal, none, sliding:W (e.g. sliding:64) or prefix:N")


def _arg_type(check):
    """An argparse type that runs ``check(text)`` and turns its ValueError into a usage error."""

    def parse(text: str):
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _mask_spec(text: str) -> str:
    parse_mask(text)
    return text


def _preset_name(text: str) -> str:
    cost.preset(text)
    return text


def _mask_picture(mask: Mask | None, nq: int, nk: int) -> str:
    if mask is None:
        return "mask: none (every query sees every key)"
    small = (min(nq, PICTURE_MAX), min(nk, PICTURE_MAX))
    head = (
        "" if small == (nq, nk) else f"the mask, drawn at {small[0]}x{small[1]} (the problem is {nq}x{nk}):\n"
    )
    return head + mask.picture(*small)


#: the most elements a tensor's shape may describe: torch counts them in a signed 64-bit integer
MAX_ELEMENTS = 2**63 - 1


def _empty(dtype: torch.dtype, q_shape: tuple, k_shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-stride q (B, Hq, Nq, D) and k = v (B, Hkv, Nk, D): the problem's shapes, nothing allocated.

    Raises:
        ValueError: a shape of more than :data:`MAX_ELEMENTS` elements (the message names the options).
    """
    for shape in (q_shape, k_shape):
        if math.prod(shape) > MAX_ELEMENTS:
            raise ValueError(
                f"--batch x heads x --seq x head dim = {' x '.join(map(str, shape))} = "
                f"{math.prod(shape):.3g} elements, more than a tensor can describe ({MAX_ELEMENTS:.3g}); "
                "lower --seq or --batch"
            )
    one = torch.empty((), dtype=dtype)
    return one.expand(*q_shape), one.expand(*k_shape)  # (B, Hq, Nq, D), (B, Hkv, Nk, D)


# -- one attention problem (the original mode) ---------------------------------------------------------
def _problem(args: argparse.Namespace) -> dict[str, Any]:
    """Which backend ``auto`` picks for the problem on the command line, its mask and one layer's walk."""
    heads, head_dim = args.heads or 8, args.head_dim or 64
    kv_heads = heads if args.kv_heads is None else args.kv_heads
    mask = parse_mask(args.mask or "causal")
    seq, dtype = args.seq or 1024, _dtype(args)
    nq = 1 if args.phase == "decode" else seq
    q, k = _empty(dtype, (args.batch, heads, nq, head_dim), (args.batch, kv_heads, seq, head_dim))
    text = explain(q, k, k, mask=mask)
    chosen, rejected = choose(make_problem(q, k, k, mask=mask))
    d_model = heads * head_dim
    ops = cost.layer_walk(
        d_model, heads, kv_heads, 4 * d_model, seq, args.batch, dtype, args.phase, head_dim=head_dim
    )
    return {
        "backend": chosen,
        "rejected": rejected,
        "explain": text,
        "d_model": d_model,
        "walk": ops,
        "mask": _mask_picture(mask, nq, seq),
    }


def _print_problem(doc: dict[str, Any], args: argparse.Namespace) -> None:
    from .console import make_console

    console = make_console()
    console.print(doc["explain"], markup=False)
    console.print()
    console.print(doc["mask"], markup=False)
    console.print()
    d = doc["d_model"]
    title = f"the layer's cost, {args.phase} (d_model={d}, d_ff={4 * d}, eq. (1)-(13))"
    console.print(walk_table(doc["walk"], title).rich())


# -- a whole model -----------------------------------------------------------------------------------
def _dtype(args: argparse.Namespace, model: cost.ModelShape | None = None) -> torch.dtype:
    if args.dtype is not None:
        return DTYPES[args.dtype]
    return (model.dtype if model is not None else None) or torch.float32


def _model(args: argparse.Namespace) -> cost.ModelShape:
    if args.hf is not None:
        return cost.from_config(cost.load_config(args.hf), name=args.hf)
    return cost.preset(args.preset)


def _default_seq(m: cost.ModelShape) -> int:
    return min(1024, m.max_len) if m.positions in ("learned", "sinusoidal") and m.max_len else 1024


def _parse_roof(spec: str) -> str | cost.Roof:
    """``measure`` or ``GFLOPS:GBPS`` (e.g. ``989000:3350``, an H100's dense bf16 rate and HBM bandwidth)."""
    if spec == "measure":
        return spec
    flops, _, gbps = spec.partition(":")
    try:
        return cost.Roof(float(flops) * 1e9, float(gbps) * 1e9, "given with --roof")
    except ValueError:
        raise ValueError(
            f"--roof must be 'measure' or GFLOPS:GBPS with positive numbers (e.g. 989000:3350), got {spec!r}"
        ) from None


def _roof(args: argparse.Namespace, dtype: torch.dtype) -> cost.Roof | None:
    spec = args.roof if args.roof is not None else ("measure" if args.plot else None)
    if not isinstance(spec, str):
        return spec
    from rich.console import Console

    with Console(stderr=True).status("measuring this machine's matmul rate and memory bandwidth"):
        return cost.measure_roof(dtype)


def _masks_in_use(m: cost.ModelShape, c: cost.Call) -> list[str]:
    """The picture of the model's mask at this call, plus a scaled one when the window is wider."""
    mask = m.mask()
    if mask is None:
        return ["mask: none (every query sees every key; padded batches add mh.key_padding)"]
    pictures = [_mask_picture(mask, c.Nq, c.Nk)]
    if m.window is not None and c.tokens > PICTURE_MAX:
        if m.window >= c.tokens:
            pictures.append(f"the window ({m.window}) holds all {c.tokens} tokens: it acts as causal here")
        else:
            w = max(1, round(m.window * PICTURE_MAX / c.tokens))
            small = (PICTURE_MAX if c.Nq > 1 else 1, PICTURE_MAX)
            pictures.append(
                f"to scale: window {m.window} of {c.tokens} tokens ~ sliding_window({w}) at {PICTURE_MAX}:\n"
                + sliding_window(w).picture(*small)
            )
    return pictures


def _backend(m: cost.ModelShape, c: cost.Call) -> tuple[str, dict[str, str]]:
    """What auto picks for one layer's attention."""
    s = m.layers[0][0]
    q, k = _empty(c.dtype, (c.batch, s.n_heads, c.Nq, s.head_dim), (c.batch, s.n_kv_heads, c.Nk, s.head_dim))
    return choose(make_problem(q, k, k, mask=m.mask()))


def _model_doc(args: argparse.Namespace) -> dict[str, Any]:
    problem_flags = [flag for key, flag in _PROBLEM_FLAGS.items() if getattr(args, key) is not None]
    if problem_flags:
        raise ValueError(
            f"{', '.join(problem_flags)} describe a single attention problem; with --preset / --hf the "
            "model decides its heads and mask: drop them"
        )
    m = _model(args)
    dtype = _dtype(args, m)
    c = cost.estimate(
        m, args.batch, args.seq or _default_seq(m), phase=args.phase, dtype=dtype, cached=args.cached
    )
    roof = _roof(args, dtype)
    chosen, rejected = _backend(m, c.call)
    doc: dict[str, Any] = {
        "cost": c,
        "backend": chosen,
        "rejected": rejected,
        "roof": roof,
        "masks": _masks_in_use(m, c.call),
        "plot": None,
    }
    if args.plot and roof is not None:
        from .console import writing

        with writing(args.plot, "--plot"):
            doc["plot"] = str(cost.plot_roofline({f"{args.phase} B={args.batch}": c}, roof, args.plot))
    return doc


def _model_json(doc: dict[str, Any]) -> dict[str, Any]:
    c: cost.Cost = doc["cost"]
    out = {**c.as_dict(), "backend": doc["backend"], "rejected": doc["rejected"], "masks": doc["masks"]}
    roof: cost.Roof | None = doc["roof"]
    if roof is not None:
        out["roof"] = {
            "peak_flops": roof.peak_flops,
            "bandwidth": roof.bandwidth,
            "label": roof.label,
            "ridge": roof.ridge,
            "seconds": c.seconds(roof),
        }
        out["roofline"] = [p.as_dict() for p in cost.roofline(c.rows, roof)]
    if doc["plot"]:
        out["plot"] = doc["plot"]
    return out


def _print_model(doc: dict[str, Any]) -> None:
    from .console import make_console
    from .explain_tables import call_line, cost_table, memory_table, roof_lines, shape_table

    c: cost.Cost = doc["cost"]
    console = make_console()
    console.print(c.model.describe(), markup=False)
    console.print(call_line(c) + f"; attention backend: auto -> {doc['backend']}", markup=False)
    console.print()
    console.print(shape_table(c).rich())
    console.print(cost_table(c, doc["roof"]).rich())
    console.print(memory_table(c).rich())
    for line in roof_lines(c, doc["roof"]):
        console.print(line, markup=False)
    console.print()
    for picture in doc["masks"]:
        console.print(picture, markup=False)
    if doc["plot"]:
        console.print(f"wrote {doc['plot']}", markup=False)


# -- the command ------------------------------------------------------------------------------------
def _cmd_explain(args: argparse.Namespace) -> int:
    """Explain an attention problem, or with --preset / --hf a whole model's cost."""
    if args.preset is None and args.hf is None:
        if args.cached is not None or args.roof is not None or args.plot is not None:
            raise ValueError("--cached, --roof and --plot need a model: add --preset NAME or --hf DIR")
        doc = _problem(args)
        if args.json:
            doc["walk"] = [o.as_dict() for o in doc["walk"]]
            print(json.dumps({k: v for k, v in doc.items() if k != "d_model"}, indent=1))
        else:
            _print_problem(doc, args)
        return 0
    if args.plot is not None:
        from .console import check_output_file

        check_output_file(args.plot, "--plot")  # before the roof is measured
    doc = _model_doc(args)
    if args.json:
        print(json.dumps(_model_json(doc), indent=1))
    else:
        _print_model(doc)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``multihead explain`` to the command line's subparsers."""
    from .args import count, positive_int

    p = sub.add_parser(
        "explain",
        help="which backend auto picks and why; a model's shape walk, cost table and roofline",
        description="Without --preset/--hf: build an attention problem of the given size, say which "
        "backend `auto` picks and why each other was rejected, draw the mask (at most "
        f"{PICTURE_MAX}x{PICTURE_MAX}), and walk one layer's FLOPs and bytes. With --preset NAME or "
        "--hf DIR: walk a whole model (nothing is allocated) - shapes, the cost of every operation of "
        "eq. (1)-(13), memory, the masks in use, and with --roof each op on the roofline.",
    )
    model = p.add_mutually_exclusive_group()
    model.add_argument(
        "--preset",
        type=_arg_type(_preset_name),
        default=None,
        help=f"a model shape: {', '.join(cost.PRESETS)}, llama-155m, llama-20m, llama-tiny",
    )
    model.add_argument("--hf", metavar="DIR", default=None, help="a Hugging Face directory (its config.json)")
    p.add_argument(
        "--seq",
        type=positive_int,
        default=None,
        help="sequence length N (keys) (default 1024, or a model's max positions if fewer)",
    )
    p.add_argument("--batch", type=positive_int, default=1, help="batch size B (default 1)")
    p.add_argument(
        "--phase",
        choices=["prefill", "decode"],
        default="prefill",
        help="prefill: N queries; decode: 1 query against N keys (default prefill)",
    )
    p.add_argument(
        "--cached",
        type=count,
        default=None,
        help="model mode: tokens in the KV cache (default 0 prefill, N-1 decode)",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="(default float32; a model's own torch_dtype with --preset / --hf)",
    )
    p.add_argument("--heads", type=positive_int, default=None, help="query heads Hq (default 8)")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="kv heads Hkv (default: --heads)")
    p.add_argument("--head-dim", type=positive_int, default=None, help="head dim D (default 64)")
    p.add_argument(
        "--mask",
        type=_arg_type(_mask_spec),
        default=None,
        help="causal | none | sliding:W | prefix:N (default causal)",
    )
    p.add_argument(
        "--roof",
        type=_arg_type(_parse_roof),
        default=None,
        help="model mode: 'measure' this machine, or GFLOPS:GBPS (e.g. 989000:3350)",
    )
    p.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="model mode: write the roofline PNG (measures the roof without --roof)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_explain)
