"""benchmarks/native_greedy_ab.py: the run turned off gives the step-by-step loop (same tokens, no native
greedy run), the model keeps its run afterwards, and a round reports both ways."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from multihead import native
from multihead.models import native_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import native_greedy_ab

REASON = native.unavailable()


@pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
def test_off_is_the_step_by_step_loop_and_on_is_restored(monkeypatch):
    model = native_greedy_ab.build("llama-20m", "int8")
    runs = []
    real = native_step.greedy_steps
    monkeypatch.setattr(native_step, "greedy_steps", lambda *a: runs.append(1) or real(*a))
    prompt = torch.randint(4, 8000, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        off = native_greedy_ab.generate(model, prompt, 6, run=False)
        assert runs == [] and "greedy_steps" not in model.__dict__
        on = native_greedy_ab.generate(model, prompt, 6, run=True)
        assert len(runs) == 1 and torch.equal(on, off)
        got = native_greedy_ab.one_round(model, prompt, 5, samples=1)
    assert set(got) == {"on", "off"} and all(set(v) == {"ms", "of_limit"} for v in got.values())
