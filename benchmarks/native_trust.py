"""What the native trust checks cost: the forward-hook check of each decode step, and the first load of a
build in a separate process.

    python benchmarks/native_trust.py            # 12-layer LLaMA shape, d=256; 3 first loads
    python benchmarks/native_trust.py --json

Hook check, per decode step, on a model with ``--layers`` layers: ``why_not_call`` as it runs (the hooks
scanned again only after a hook was registered anywhere), the comparison that check adds to it (against
an empty call, the floor of the timing loop), and a scan of every replaced module at every step (the
plain way to honour hooks registered later); next to one whole native decode step. Each
is the fastest of ``--rounds`` rounds of ``--calls`` calls (``--calls // 20`` decode steps), the rows
taking turns within each round: on a shared machine other work only ever adds time.

First load: a fresh build's first load and self-check in a separate Python process (once per build; the
library's checked record keeps later starts from repeating it), against the same load and self-check in
this process, and the compile itself (one build into a private temporary directory).
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch

import multihead as mh
from multihead import native
from multihead.models import native_step, quant
from multihead.native import build, cache, first_load


def _per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def hook_check(layers: int, calls: int, rounds: int) -> dict:
    """Microseconds per call of each row (the fastest round) and their ratios to the step."""
    torch.manual_seed(0)
    lm = mh.TransformerLM(1000, 256, layers, 8, 688, n_kv_heads=4).eval()
    model = quant.quantize(lm, weights="fp32", kv=None, kernel="native")
    assert model.why_not_native_steps is None, model.why_not_native_steps
    one = torch.tensor([[5]])
    kv = model.make_cache(1, 4 * calls + 64)
    stamp = native_step.RemovableHandle  # the counter every hook registration advances
    state = model.__dict__

    def decode_steps() -> float:
        for c in kv:  # rewind to 3 positions: the steps overwrite the same ones
            c.reset()
            c.advance(3)
        return _per_call_us(lambda: native_step.decode_step(model, one, kv), max(1, calls // 20))

    rows = {
        "why_not_call (hooks checked per step)": lambda: _per_call_us(
            lambda: native_step.why_not_call(model, one, None, kv), calls
        ),
        "the hook check's comparison alone": lambda: _per_call_us(
            lambda: state.get("_native_hooks_stamp") != stamp.next_id, calls
        ),
        "an empty call (the timing floor)": lambda: _per_call_us(lambda: None, calls),
        "hook scan of every module each step": lambda: _per_call_us(
            lambda: native_step._hooks_reason(model), calls
        ),
        "native decode step": decode_steps,
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    with torch.no_grad():
        model.hidden_states(torch.tensor([[1, 2, 3]]), cache=kv)
        for _ in range(rounds):
            for name, row in rows.items():
                times[name].append(row())
    med = {name: min(v) for name, v in times.items()}
    step = med["native decode step"]
    return {
        "layers": layers,
        "modules scanned": sum(1 for _ in model.layers.modules()) + 2,
        "us": med,
        "of a step": {name: v / step for name, v in med.items()},
        "hook check added per step (us)": med["the hook check's comparison alone"]
        - med["an empty call (the timing floor)"],
    }


def _children_cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child processes it ran) of ``fn()``."""
    cpu, start = _children_cpu_s(), time.perf_counter()
    fn()
    return time.perf_counter() - start, _children_cpu_s() - cpu


def first_load_cost(repeats: int) -> dict:
    """Seconds, wall and CPU: the first load + self-check in a separate process, the same in this one,
    and a compile (the CPU seconds count the child processes: less moved by other work than the wall
    time on a shared machine)."""
    so = native.location()
    assert so is not None, native.unavailable()
    digest = cache.file_digest(so)
    init = Path(native.__file__)

    def apart() -> None:
        assert first_load.check_apart(init, so, digest) is None

    def here() -> None:
        assert native._self_check(native.open_library(so)) is None

    compiler, _ = build.find_compiler()
    assert compiler is not None
    with tempfile.TemporaryDirectory() as d:
        args = [*native.FLAGS, native.OPENMP, *map(str, native.SOURCES), "-lm"]
        built = _timed(lambda: build.compile_library(compiler, args, native.OPENMP, Path(d) / so.name))
    aparts = [_timed(apart) for _ in range(repeats)]
    heres = [_timed(here)[0] for _ in range(repeats)]
    return {
        "separate process, wall (s)": min(w for w, _ in aparts),
        "separate process, CPU (s)": min(c for _, c in aparts),
        "in this process, wall (s)": min(heres),
        "compile, wall (s)": built[0],
        "compile, CPU (s)": built[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--first-loads", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = {
        "hook check": hook_check(args.layers, args.calls, args.rounds),
        "first load": first_load_cost(args.first_loads),
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return
    h = out["hook check"]
    print(f"hook check, {h['layers']} layers ({h['modules scanned']} modules the native step replaces):")
    for name, us in h["us"].items():
        print(f"  {name:42s} {us:9.2f} us  {h['of a step'][name]:7.4f} of a step")
    print(f"  the hook check adds {h['hook check added per step (us)']:.2f} us per step")
    f = out["first load"]
    print("first load of a build:")
    for name, v in f.items():
        print(f"  {name:42s} {v:9.3f}")


if __name__ == "__main__":
    main()
