"""Time the same three workloads on two source trees, alternating subprocesses (one thread each).

    git worktree add /tmp/before <commit>
    python benchmarks/compare_commits.py /tmp/before/src src --rounds 5

Workloads: tiled causal attention forward + backward (B=1, Hq=8, Hkv=2, N=2048, D=64); 50 small
MultiHeadAttention calls (d 256, 4 heads, N 16: the per-call Python overhead of the module); greedy
generation of 32 tokens with ``random_lm("llama-tiny")``. Prints each round's seconds and the median ratio
after/before per workload: rounds alternate, so load from other work slows both trees alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, time, torch
torch.set_num_threads(1)
import multihead as mh

def med(f, r):
    f()
    ts = []
    for _ in range(r):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]

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
res = {"tiled fwd+bwd": med(tiled, 3), "50 module calls": med(module, 5), "generate 32": med(generate, 3)}
print(json.dumps(res))
"""


def run(src: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="the src/ folder of the earlier tree")
    ap.add_argument("after", help="the src/ folder of the later tree")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    ratios: dict[str, list[float]] = {}
    for i in range(args.rounds):
        a, b = run(args.before), run(args.after)
        print(f"round {i + 1}: before {a}\n         after  {b}", flush=True)
        for key in a:
            ratios.setdefault(key, []).append(b[key] / a[key])
    for key, r in ratios.items():
        print(f"{key}: after/before median {statistics.median(r):.2f} (range {min(r):.2f}-{max(r):.2f})")


if __name__ == "__main__":
    main()
