"""The native decode layers of two source trees in one process: the same model, cache and step.

    git worktree add /tmp/before <commit>
    python benchmarks/native_layers_ab.py /tmp/before/src --precision int8 --context 256 --threads 1

Builds the other tree's native C sources (``multihead/native/*.c``) with this tree's compiler flags into
a temporary directory, loads them with this tree's declarations, and times one decode step of a
quantized ``llama-155m`` (random weights) through each build: the layers' plans differ only in the
library they call, the cache is reset to ``--context`` positions before every step, and the two steps'
samples are interleaved by :func:`multihead.bench.timing.measure_all`, so load from other work slows
both alike. Prints the median step of each build with its spread, their ratio (this / other), and the
same at an empty cache (the attention's share is the difference). Only the layers differ: the embedding
lookup and the final norm are this tree's; the output head is not in the step.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import torch

import multihead as mh
from multihead import native
from multihead.bench import timing
from multihead.models import native_step, quant

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
    sources = [src / "multihead" / "native" / f.name for f in native.SOURCES]
    missing = [str(f) for f in sources if not f.is_file()]
    if missing:
        raise ValueError(f"{src} is not a multihead source tree: missing {missing}")
    compiler, why = native.build.find_compiler()
    if compiler is None:
        raise ValueError(f"no C compiler: {why}")
    lib = out / "other.so"
    cmd = [*compiler, *native.FLAGS, native.OPENMP, "-o", str(lib), *map(str, sources), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=native.build.TIMEOUT_S)
    if done.returncode != 0:
        raise ValueError(f"the other tree's sources did not compile: {done.stderr.strip()[-2000:]}")
    return lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("other_src", type=Path, help="the other tree's src directory")
    p.add_argument("--precision", default="int8", choices=list(PRECISIONS))
    p.add_argument("--preset", default="llama-155m")
    p.add_argument("--context", type=int, default=256, help="cached positions before the step (default 256)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    reason = native.unavailable()
    if reason is not None:
        raise SystemExit(f"the native kernels are unavailable here: {reason}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = quant.quantize(mh.pretrained.random_lm(args.preset), **PRECISIONS[args.precision])
    why = getattr(model, "why_not_native_steps", None)
    if why is not None:
        raise SystemExit(f"this model takes no native steps: {why}")
    kind = "int8" if PRECISIONS[args.precision]["kv"] == "int8" else "dense"
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        other = native.open_library(build_other(args.other_src, Path(tmp)))
        libs = {"other": other, "this": native.library()}
        cache = model.make_cache(1, args.context + 8, kind)
        if args.context:
            model.hidden_states(torch.randint(4, model.vocab_size, (1, args.context)), cache=cache)
        plans = {k: native_step._Plan(model, cache, lib) for k, lib in libs.items()}
        ids = torch.tensor([[5]])  # (1, 1)

        def step(which: str, at: int) -> None:
            model.__dict__["_native_plan"] = plans[which]
            for kv in cache:  # back to `at` positions: the step writes position `at` again
                kv.reset()
                if at:
                    kv.advance(at)
            native_step.decode_step(model, ids, cache)

        for at in (args.context, 0):
            got = timing.measure_all({k: (lambda k=k, at=at: step(k, at)) for k in libs}, min_total=2.0)
            ratio = timing.compare(got["this"], got["other"])
            print(
                f"{args.precision}, {args.threads} thread(s), {at} cached positions: "
                f"other {got['other']}, this {got['this']}, this / other {ratio}"
            )


if __name__ == "__main__":
    main()
