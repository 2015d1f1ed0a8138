"""benchmarks/gpu_check.py at toy sizes on the CPU: its pieces run, judge and report what they should.

The whole ``--device cpu --small`` run takes a couple of minutes on a busy 2-core machine; these tests run
one or two cases of each part instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import multihead as mh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check
import gpu_correct
import gpu_hf
import gpu_speed
from gpu_timing import Budget

CPU = torch.device("cpu")


def test_correctness_rows_follow_the_numerics_rule():
    rows = gpu_correct.correctness(CPU, True, Budget(120), only=["causal + sinks", "ragged length"])
    judged = [r for r in rows if "ok" in r]
    assert {r["case"] for r in judged} == {"causal + sinks", "ragged length"}
    assert {r["backend"] for r in judged} >= {"auto", "tiled"}
    assert all(r["ok"] for r in judged), [r for r in judged if not r["ok"]]
    for r in judged:  # allowed = 2x / 3x the same-dtype matrix error, floor 1e-5
        assert r["out_allowed"] >= 1e-5 and len(r["grads"]) == 3
    assert "0 over" not in gpu_correct.table(rows)  # the table lists rows; the count is gpu_check's


def test_a_wrong_backend_is_counted_over_tolerance():
    base = {"out": 1e-3, "grads": [1e-3, 1e-3, 1e-3]}
    assert gpu_correct._judge({"out": 2.5e-3, "grads": [1e-3] * 3}, base)["ok"] is False
    assert gpu_correct._judge({"out": 1e-3, "grads": [1e-3, 4e-3, 1e-3]}, base)["ok"] is False
    assert gpu_correct._judge({"out": 2e-3, "grads": [3e-3] * 3}, base)["ok"] is True


def test_speed_rows_time_every_method_and_say_what_cannot_serve():
    rows = gpu_speed.speed(CPU, True, 1, Budget(120), False, only=["causal + sinks"])
    assert [r["case"] for r in rows] == ["causal + sinks, fwd", "causal + sinks, fwd+bwd"]
    for r in rows:
        assert r["cells"]["auto"]["ms"] > 0 and r["cells"]["auto"]["first_ms"] > 0
        assert r["cells"]["sdpa"]["skipped"] == "cannot: no sinks"
        for name in gpu_speed.FUSED:
            assert (
                "ms" in r["cells"][name] or "skipped" in r["cells"][name]
            ) and name in gpu_check.speed_table(rows)


def test_speed_ratios_are_peer_time_over_ours():
    cells = {"auto": {"ms": 2.0}, "triton": {"ms": 1.0}, "sdpa": {"ms": 3.0}, "torch flex": {"skipped": "x"}}
    assert gpu_speed.ratios(cells) == {"auto vs sdpa": 1.5, "triton vs sdpa": 3.0}


def test_a_spent_budget_skips_rows_instead_of_running_them():
    rows = gpu_speed.speed(CPU, True, 1, Budget(0), False, only=["causal"])
    reasons = [c["skipped"] for r in rows for c in r["cells"].values()]
    assert all("budget" in why or "not registered" in why for why in reasons) and reasons
    assert all("ms" not in c for r in rows for c in r["cells"].values())


def test_new_mask_rows_name_unregistered_backends():
    rows = gpu_speed.new_masks(CPU, True, 1, Budget(0))
    for r in rows:
        if r["backend"] not in mh.backends():
            assert r["skipped"] == "not registered here"


def test_new_mask_rows_time_the_first_and_second_call_of_each_new_mask(monkeypatch):
    monkeypatch.setattr(gpu_speed, "FUSED", ("tiled",))  # a backend every machine has, timed by name
    rows = gpu_speed.new_masks(CPU, True, 1, Budget(120))
    timed = [r for r in rows if "first_ms" in r]
    assert {r["what"] for r in timed} == {"new window size", "new document layout", "new length"}
    assert {r["grad"] for r in timed} == {False, True}
    for r in timed:  # the second call of the same mask, timed as the first, next to it
        assert r["second_ms"] > 0 and r["first_over_second"] == round(r["first_ms"] / r["second_ms"], 2)


def test_the_plan_alone_is_built_afresh_with_the_gpu_blocks():
    """``plan_ms`` times the triton plan of a new mask, built without the cache (a cached plan would time
    a dictionary lookup), with the block sizes a GPU launch uses."""
    from multihead.backends.triton import launch, plan
    from multihead.core.problem import make_problem

    plan.clear_cache()
    q = torch.randn(1, 2, 300, 16, dtype=torch.bfloat16)
    got = gpu_speed._plan_only(q, q, q, mh.sliding_window(40))
    blocks = launch.make_launch(make_problem(q, q, q, mask=mh.sliding_window(40)), interpret=False).fwd_blocks
    assert (got.bm, got.bn) == blocks and got.n_partial > 0 and not plan._CACHE


def test_served_counts_the_backend_that_ran_and_restores_it():
    from multihead.backends import registry

    q = torch.randn(1, 2, 40, 8)
    before = registry.get("tiled").run
    with gpu_hf.served() as seen:
        mh.attention(q, q, q, mask=mh.sliding_window(5), backend="tiled")
        mh.attention(q, q, q, backend="sdpa")
    assert seen == {"tiled": 1, "sdpa": 1}
    assert registry.get("tiled").run == before


def test_hf_tiny_shapes_run_through_multihead_and_match_eager():
    pytest.importorskip("transformers", reason="the Hugging Face part needs transformers")
    rows = gpu_hf.tiny_rows(CPU, True, Budget(120))
    for r in rows:
        assert "skipped" not in r, r
        assert sum(r["served_by"].values()) == 2  # one attention call per layer, both through multihead
        assert r["max_abs_logit_diff_vs_eager"] < 1e-4


def test_past_the_budget_only_the_methods_that_compile_per_mask_stop_first():
    budget = Budget(100)
    budget.start -= 110  # 10 s over: within the half-budget grace of the cheap methods
    assert "ms" in gpu_speed._cell("sdpa", lambda: None, CPU, 1, budget)
    assert "budget" in gpu_speed._cell("torch flex", lambda: None, CPU, 1, budget)["skipped"]
    budget.start -= 50  # 60 s over: everything stops
    assert "budget" in gpu_speed._cell("sdpa", lambda: None, CPU, 1, budget)["skipped"]


def test_gpu_blocks_settings_reach_the_launch(monkeypatch):
    """benchmarks/gpu_blocks.py swaps the kernels' block settings by replacing ``launch._blocks``: a
    setting it makes must be the one a new launch uses (the sweep would time the defaults otherwise),
    and its first entries must be the library's current defaults, as its report says."""
    import gpu_blocks

    from multihead.backends.triton import launch
    from multihead.core.problem import make_problem

    default = launch._blocks(128, False, False)
    assert gpu_blocks.settings(gpu_blocks.FORWARD[0], gpu_blocks.BACKWARD[0]) == default
    monkeypatch.setattr(launch, "_blocks", launch._blocks)  # restored after the test
    chosen = gpu_blocks.settings(gpu_blocks.FORWARD[1], gpu_blocks.BACKWARD[1])
    gpu_blocks.use(chosen)
    q = torch.zeros(1, 2, 40, 128, dtype=torch.bfloat16)
    run = launch.make_launch(make_problem(q, q, q, mask=mh.causal()), interpret=True)
    assert run.fwd_blocks == gpu_blocks.FORWARD[1][0] and run.bwd_warps == gpu_blocks.BACKWARD[1][2]
