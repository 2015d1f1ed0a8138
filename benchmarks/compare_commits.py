"""Time the same three workloads on two source trees, alternating subprocesses (one thread each).

    git worktree add /tmp/before <commit>
    python benchmarks/compare_commits.py /tmp/before/src src --rounds 5

Workloads: tiled causal attention forward + backward (B=1, Hq=8, Hkv=2, N=2048, D=64); 50 small
MultiHeadAttention calls (d 256, 4 heads, N 16: the per-call Python overhead of the module); greedy
generation of 32 tokens with ``random_lm("llama-tiny")``. Each child times its workloads with this
tree's ``multihead/cost/timing.py`` (loaded by path: the earlier tree may not have it; samples long
enough for the clock, interleaved), so both trees are timed alike. Prints each round's seconds and, per
workload, the ratio after/before of the medians over the rounds, "same within noise" where the rounds'
spreads overlap: rounds alternate, so load from other work slows both trees alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

TIMING = Path(__file__).resolve().parents[1] / "src" / "multihead" / "cost" / "timing.py"

CHILD = r"""
import importlib.util, json, sys, torch
torch.set_num_threads(1)
import multihead as mh

spec = importlib.util.spec_from_file_location("compare_commits_timing", sys.argv[1])
timing = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = timing  # dataclasses look their module up
spec.loader.exec_module(timing)

g = torch.Generator().manual_seed(0)
q = torch.randn(1, 8, 2048, 64, generator=g, requires_grad=True)
k, v = (torch.randn(1, 2, 2048, 64, generator=g, requires_grad=True) for _ in range(2))
def tiled():
    mh.attention(q, k, v, mask=mh.causal(), backend="tiled").sum().backward()
m, x = mh.MultiHeadAttention(256, 4).eval(), torch.randn(1, 16, 256)
def module():
    with torch.no_grad():
        for _ in range(50):
            m(x, mask=mh.causal())
lm, ids = mh.pretrained.random_lm("llama-tiny"), torch.randint(0, 100, (1, 64))
def generate():
    lm.generate(ids, 32)
calls = {"tiled fwd+bwd": tiled, "50 module calls": module, "generate 32": generate}
t = timing.measure_all(calls, min_samples=3)
print(json.dumps({k: x.median for k, x in t.items()}))
"""


def run(src: str) -> dict[str, float | None]:
    """Median seconds per workload in a child on the tree ``src`` (None: too short to measure)."""
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, "-c", CHILD, str(TIMING)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_timing() -> ModuleType:
    """This tree's timing helper, loaded by path (it needs the standard library only)."""
    spec = importlib.util.spec_from_file_location("compare_commits_timing", TIMING)
    assert spec is not None and spec.loader is not None
    timing = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = timing  # dataclasses look their module up
    spec.loader.exec_module(timing)
    return timing


def verdicts(before: list[dict], after: list[dict]) -> dict[str, str]:
    """Per workload, after / before over the rounds' medians (``timing.compare`` of
    ``timing.from_samples``): "0.85x", "same within noise" or "too short to
    measure" (a round without a number)."""
    timing = load_timing()
    out = {}
    for key in before[0]:
        sides = []
        for rounds in (after, before):
            xs = [r[key] for r in rounds]
            sides.append(timing.from_samples(xs) if None not in xs else timing.from_samples([]))
        out[key] = str(timing.compare(*sides))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="the src/ folder of the earlier tree")
    ap.add_argument("after", help="the src/ folder of the later tree")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    before, after = [], []
    for i in range(args.rounds):
        before.append(run(args.before))
        after.append(run(args.after))
        print(f"round {i + 1}: before {before[-1]}\n         after  {after[-1]}", flush=True)
    for key, verdict in verdicts(before, after).items():
        print(f"{key}: after/before {verdict} (medians of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
