"""The native decode layers of two source trees in one process: the same model, cache and step.

    git worktree add /tmp/before <commit>
    python benchmarks/native_layers_ab.py /tmp/before/src --precision int8 --context 256 --threads 1

Builds the other tree's native C sources (``multihead/native/*.c``) with this tree's compiler flags into a
temporary directory, loads them with this tree's declarations (so the other tree must have this one's
entry points: ``mh_decode_layers``, a step's layers in one call, from 2026-11-27 on), and times one decode
step of a quantized ``llama-155m`` (random weights) through each build: the layers' plans differ only in
the library they call, the cache is reset to ``--context`` positions before every step, and the two steps'
samples are interleaved by :func:`multihead.bench.timing.measure_all`, so load from other work slows both
alike. Prints the median step of each build with its spread, their ratio (this / other), and the same at
an empty cache (the attention's share is the difference). Only the layers and the final norm differ: the
embedding lookup is this tree's; the output head is not in the step.

    python benchmarks/native_layers_ab.py --layouts --precision int8 --context 256 --threads 1

compares instead, with this tree's library alone, the int8 model whose rows lie in the blocked layout
(what ``quantize`` keeps where the kernel is AVX512-VNNI's) against a copy of it with every row put back
in column order (the kernel's plain layout), the same way.

    python benchmarks/native_layers_ab.py /tmp/before/src --products --precision int8 --threads 1

times instead the model's matrix-vector products alone (every linear layer and the output head, one
token, in one native call as a step makes them: :func:`multihead.native.products`) through each build,
interleaved, three rounds: each build's GB/s over the weights' bytes and its share of a plain read of
as many bytes measured right after (:func:`multihead.bench.floors.read_bandwidth`).
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import tempfile
from pathlib import Path

import torch

import multihead as mh
from multihead import native
from multihead.bench import timing
from multihead.bench.floors import read_bandwidth
from multihead.models import native_step, quant
from multihead.models.gemv_linear import GemvLinear
from multihead.native import hugepages

PRECISIONS = {
    "fp32": {"weights": "fp32", "kv": None, "kernel": "native"},
    "bf16": {"weights": "bf16", "kv": None, "kernel": "native"},
    "fp16": {"weights": "fp16", "kv": None, "kernel": "native"},
    "int8": {"weights": "int8", "kv": "int8", "kernel": "native", "group_size": 32},
    "int8-row": {"weights": "int8", "kv": "int8", "kernel": "native", "group_size": None},
}


def build_other(src: Path, out: Path) -> Path:
    """The other tree's native library, built with this tree's flags.

    Raises:
        ValueError: the tree has no native sources, or they do not compile (the compiler's message).
    """
    here = src / "multihead" / "native"
    sources = sorted(here.glob("*.c"))  # the other tree's own files (this one's list may name newer ones)
    if not (here / "native.h").is_file() or not sources:
        raise ValueError(f"{src} is not a multihead source tree: no {here}/native.h and C files")
    compiler, why = native.build.find_compiler()
    if compiler is None:
        raise ValueError(f"no C compiler: {why}")
    lib = out / "other.so"
    cmd = [*compiler, *native.FLAGS, native.OPENMP, "-o", str(lib), *map(str, sources), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=native.build.TIMEOUT_S)
    if done.returncode != 0:
        raise ValueError(f"the other tree's sources did not compile: {done.stderr.strip()[-2000:]}")
    return lib


def in_column_order(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of an int8 model with every blocked row put back in column order (the tied embedding too).

    Raises:
        ValueError: a model without blocked int8 rows.
    """
    out = copy.deepcopy(model)
    linears = [m for m in out.modules() if isinstance(m, quant.Int8GemvLinear) and m.blocked]
    if not linears:
        raise ValueError("the model has no blocked int8 rows (int8 weights on an AVX512-VNNI kernel have)")
    for m in out.modules():
        if isinstance(m, (quant.Int8GemvLinear, quant.Int8Embedding)) and m.blocked:
            if getattr(m, "packed", False):
                m.set_packed(False)  # the scales apart first: the rows alone change order
            m.weight_int8, m.blocked = m.int8_weight, False
    # in one huge-page arena, as quantize(kernel="native") keeps the original's tensors: a deep copy's
    # fresh tensors lie on 4 KiB pages and read slower for that alone
    hugepages.move_to_huge_pages([*out.parameters(), *out.buffers()], min_bytes=0)
    return out


def _timed(models: dict, context: int, precision: str, threads: int, lib_of: dict) -> None:
    """Interleaved decode steps of each named model (with its own cache and library), at ``context``
    cached positions and at none; prints both and the ratio of the first name to the second."""
    kind = "int8" if PRECISIONS[precision]["kv"] == "int8" else "dense"
    prompt = torch.randint(4, next(iter(models.values())).vocab_size, (1, max(context, 1)))
    plans, caches = {}, {}
    for name, model in models.items():
        cache = caches[name] = model.make_cache(1, context + 8, kind)
        if context:
            model.hidden_states(prompt, cache=cache)
        plans[name] = native_step._Plan(model, cache, lib_of[name])
    ids = torch.tensor([[5]])  # (1, 1)

    def step(name: str, at: int) -> None:
        model, cache = models[name], caches[name]
        model.__dict__["_native_plan"] = plans[name]
        for kv in cache:  # back to `at` positions: the step writes position `at` again
            kv.reset()
            if at:
                kv.advance(at)
        native_step.decode_step(model, ids, cache)

    first, second = list(models)
    for at in (context, 0):
        got = timing.measure_all({k: (lambda k=k, at=at: step(k, at)) for k in models}, min_total=2.0)
        ratio = timing.compare(got[first], got[second])
        print(
            f"{precision}, {threads} thread(s), {at} cached positions: "
            f"{second} {got[second]}, {first} {got[first]}, {first} / {second} {ratio}"
        )


def product_bounds(model: torch.nn.Module) -> tuple[list[native.Bound], int]:
    """Every native product of ``model``'s linear layers (the head included) on a random token, and the
    bytes of their weights (and int8 scales).

    Raises:
        ValueError: a layer whose call would not run a native kernel.
    """
    bounds, nbytes = [], 0
    for m in model.modules():
        if isinstance(m, quant.Int8GemvLinear):
            x, nbytes = torch.randn(1, 1, m.in_features), nbytes + m.weight_int8.nbytes + m.scale.nbytes
        elif isinstance(m, GemvLinear):
            x, nbytes = torch.randn(1, 1, m.in_features).to(m.weight.dtype), nbytes + m.weight.nbytes
        else:
            continue
        bound = m.native_product(x)  # (1, 1, I) in, the layer's own product
        if bound is None:
            raise ValueError(f"{type(m).__name__} {m.extra_repr()} runs no native kernel here")
        bounds.append(bound)
    return bounds, nbytes


def _products(model: torch.nn.Module, precision: str, threads: int, lib_of: dict) -> None:
    """The model's products through each named library, interleaved, three rounds; prints GB/s and the
    share of a plain read of as many bytes, measured after each round."""
    bounds, nbytes = product_bounds(model)
    calls = {name: native.products(lib, bounds) for name, lib in lib_of.items()}
    for _ in range(3):
        got = timing.measure_all(calls, min_total=3.0)
        probe = read_bandwidth(nbytes)
        rates = {k: nbytes / got[k].median for k in calls}
        shown = ", ".join(f"{k} {r / 1e9:.1f} GB/s ({r / probe:.0%})" for k, r in rates.items())
        print(
            f"{precision}, {threads} thread(s), {len(bounds)} products, {nbytes / 1e6:.0f} MB: {shown}; "
            f"plain read {probe / 1e9:.1f} GB/s; this / other {timing.compare(got['this'], got['other'])}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("other_src", type=Path, nargs="?", help="the other tree's src directory")
    p.add_argument("--layouts", action="store_true", help="blocked int8 rows against rows in column order")
    p.add_argument("--products", action="store_true", help="the products alone, not the layers")
    p.add_argument("--precision", default="int8", choices=list(PRECISIONS))
    p.add_argument("--preset", default="llama-155m")
    p.add_argument("--context", type=int, default=256, help="cached positions before the step (default 256)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    if (args.other_src is None) == (not args.layouts):
        raise SystemExit("give the other tree's src directory, or --layouts (not both)")
    if args.products and args.layouts:
        raise SystemExit("--products compares two trees' kernels: give the other tree's src, not --layouts")
    reason = native.unavailable()
    if reason is not None:
        raise SystemExit(f"the native kernels are unavailable here: {reason}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = quant.quantize(mh.pretrained.random_lm(args.preset), **PRECISIONS[args.precision])
    why = getattr(model, "why_not_native_steps", None)
    if why is not None:
        raise SystemExit(f"this model takes no native steps: {why}")
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        if args.layouts:
            try:
                plain = in_column_order(model)
            except ValueError as e:
                raise SystemExit(str(e)) from None
            lib = native.library()
            models = {"blocked": model, "in order": plain}
            _timed(models, args.context, args.precision, args.threads, dict.fromkeys(models, lib))
            return
        other = native.open_library(build_other(args.other_src, Path(tmp)))
        if args.products:
            _products(model, args.precision, args.threads, {"this": native.library(), "other": other})
            return
        models = {"this": model, "other": model}
        _timed(models, args.context, args.precision, args.threads, {"this": native.library(), "other": other})


if __name__ == "__main__":
    main()
