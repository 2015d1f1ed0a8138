"""A rank that dies or stalls makes the job fail fast with a clear error: no hang, no partial result.

The bound is a liveness bound, not a speed test: it is measured from the moment the rank dies or stalls
(process start-up on a shared 2-core machine is not counted) and allows the timeouts set here plus slack.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import multihead as mh
from multihead.bench.distributed import render_distributed_bench, run_distributed_bench, world_sizes_up_to
from multihead.parallel import LaunchError, launch, ring_attention, shard

RING_TIMEOUT = 5.0  # seconds a surviving rank waits for a message
GRACE = 5.0  # seconds the launcher gives the other ranks after the first failure
BOUND = RING_TIMEOUT + GRACE + 20.0  # seconds from the casualty to the launcher's error


def _ring_with_a_casualty(rank: int, world: int, how: str, stamp: str) -> str:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8 * world, 8) for _ in range(3))
    local = [shard(t) for t in (q, k, v)]
    ring_attention(*local, mask=mh.causal(), timeout=RING_TIMEOUT)  # one healthy call first
    if rank == 1:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))  # when the casualty happens
        if how == "dies":
            os._exit(3)
        time.sleep(1000)  # stalls: the launcher stops it
    ring_attention(*local, mask=mh.causal(), timeout=RING_TIMEOUT)
    return "complete"


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_dead_or_stalled_rank_fails_the_job_fast(how, tmp_path):
    stamp = tmp_path / "casualty"
    with pytest.raises(LaunchError) as info:
        launch(_ring_with_a_casualty, 2, how, str(stamp), timeout=300, op_timeout=30, grace=GRACE)
    elapsed = time.time() - float(stamp.read_text())
    assert elapsed < BOUND, f"the job stopped {elapsed:.1f} s after rank 1 {how}"
    msg = str(info.value)
    assert "no results are returned" in msg
    if how == "dies":
        assert "rank 1: process exited with code 3 without returning a result" in msg
    else:
        assert "rank 1: still running 5 s after rank 0 failed; stopped" in msg
    # the survivor stopped on its own, with the communication error naming the step and the peer
    assert "rank 0: CommError: ring_attention rank 0/2" in msg, msg
    assert "A peer rank died or stalled; no partial result is returned" in msg
    assert set(info.value.failures) == {0, 1}


def _raises(rank: int, world: int) -> None:
    raise ValueError(f"boom on rank {rank}")


def test_an_exception_on_one_rank_is_reported_with_its_traceback():
    with pytest.raises(LaunchError, match="rank 0: ValueError: boom on rank 0") as info:
        launch(_raises, 1, timeout=60)
    assert "Traceback" in info.value.tracebacks[0]


def test_launch_validates_its_arguments():
    with pytest.raises(ValueError, match=r"launch world_size must be an int >= 1, got 0"):
        launch(_raises, 0)
    with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds > 0, got -1"):
        launch(_raises, 1, timeout=-1)


def test_distributed_bench_smoke():
    res = run_distributed_bench((2,), 512, heads=1, head_dim=16, timeout=60)
    (row,) = res["rows"]
    assert row["world_size"] == 2 and row["tokens_per_rank"] == 256 and row["finite"]
    assert row["sent_bytes"] == 256 * 16 * 4 * 2  # one K and one V shard of fp32 passed on
    # tiny shards may not raise the peak RSS at all (allocator reuse): only a sane, finite figure
    assert row["peak_bytes"] is None or row["peak_bytes"] >= 0
    assert "| 2 | 256 |" in render_distributed_bench(res)


def test_bench_rejects_unknown_masks():
    with pytest.raises(
        ValueError, match=r"mask must be one of \['none', 'causal', 'sliding_window'\], got 'diag'"
    ):
        run_distributed_bench((1,), 64, mask="diag")


@pytest.mark.parametrize(("n", "want"), [(1, (1,)), (4, (1, 2, 4)), (6, (1, 2, 4, 6))])
def test_world_sizes_up_to(n, want):
    assert world_sizes_up_to(n) == want


def test_world_sizes_up_to_rejects_zero():
    with pytest.raises(ValueError, match=r"number of processes must be an int >= 1, got 0"):
        world_sizes_up_to(0)
