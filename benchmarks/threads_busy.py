"""`multihead generate` on a machine with another busy process: default threads against `--threads 1`.

    python benchmarks/threads_busy.py                        # 5 rounds, the default preset
    python benchmarks/threads_busy.py --before /path/to/src  # also an older tree's default, same rounds

Starts one busy loop (`python -c "while 1: pass"`) for the whole run, then runs `multihead generate
--json` in fresh processes, interleaved round after round: the default thread choice and `--threads 1`
(and, with --before, the default of another source tree). Reports the median decode tokens/s of each
and the ratio default / --threads 1 (the goal: at least 1/1.2 of --threads 1). The machine is shared
with the busy loop by design; on a machine already shared with other work the ratios still come from
the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _rate(src: Path, extra: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "multihead", "generate", "--json", *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)["decode_tokens_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", type=Path, default=None, help="another tree's src/ to run its default too")
    ap.add_argument("--args", default="", help="extra generate arguments, e.g. '--preset llama-20m'")
    args = ap.parse_args()
    extra = args.args.split()
    runs = {"default": (SRC, extra), "--threads 1": (SRC, [*extra, "--threads", "1"])}
    if args.before is not None:
        runs["before: default"] = (args.before, extra)
    rates: dict[str, list[float]] = {k: [] for k in runs}
    busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        for _ in range(args.rounds):
            for name, (src, more) in runs.items():
                rates[name].append(_rate(src, more))
    finally:
        busy.kill()
        busy.wait()
    one = statistics.median(rates["--threads 1"])
    print(
        f"multihead generate {args.args or '(default preset)'} with one busy process; cores: {os.cpu_count()}"
    )
    for name, xs in rates.items():
        med = statistics.median(xs)
        spread = f"(min {min(xs):.1f}, max {max(xs):.1f})"
        print(f"  {name:16s} {med:9.1f} tok/s {spread}; {med / one:.2f}x --threads 1")


if __name__ == "__main__":
    main()
