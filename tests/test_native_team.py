"""One-row decode steps on one team of threads (decode_layer.c: every layer in one parallel region, each
thread with its own copy of the row, the products split across the team, the kv heads shared out): the
bits of the one-thread step, for every weight kind and cache, with kv heads that split unevenly or leave a
thread none, and for the greedy runs built on them."""

from __future__ import annotations

import copy

import pytest
import torch

import multihead as mh
from multihead import native
from multihead.models import quant

REASON = native.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")

#: a step runs on one team when its first product (q, k and v) has at least this many weights
#: (native.h's MH_PAR_MIN: the size at which products split across the threads)
TEAM_MIN = 1 << 18

#: (d, query heads, kv heads, interleaved rotary)
SHAPES = [
    (512, 8, 2, False),  # one kv head a thread
    (512, 8, 1, True),  # one kv head: the second thread attends nothing; pairs rotated (2i, 2i + 1)
    (432, 6, 3, False),  # head dim 72 (16-lane steps and an 8-value tail); three kv heads over two threads
]
#: quantize arguments and the cache kind
KINDS = {
    "fp32": ({"weights": "fp32", "kv": None}, "dense"),
    "bf16": ({"weights": "bf16", "kv": None}, "dense"),
    "fp16": ({"weights": "fp16", "kv": None}, "dense"),
    "int8 g32": ({"weights": "int8", "kv": "int8", "group_size": 32}, "int8"),
    "int8 per row": ({"weights": "int8", "kv": "int8", "group_size": None}, "int8"),
}


def _model(d: int, n_heads: int, n_kv_heads: int, interleaved: bool, kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    lm = mh.TransformerLM(300, d, 2, n_heads, 2 * d, n_kv_heads=n_kv_heads, norm_eps=1e-6).eval()
    for layer in lm.layers:
        layer.self_attn.rotary.interleaved = interleaved
    with torch.no_grad():  # non-trivial norm gains, so a gain applied twice or not at all shows
        for m in lm.modules():
            if isinstance(m, mh.nn.norms.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    q = quant.quantize(lm, kernel="native", **KINDS[kind][0])
    assert q.why_not_native_steps is None
    return q


def _prefilled(model: torch.nn.Module, kind: str) -> list:
    """The caches after a 40-token prompt, prefilled on one thread.

    A float prompt longer than native_step.ROWS_FLOAT runs the eager layers, whose products are torch's
    (MKL's GEMM for fp32): on Intel CPUs MKL splits the sums of some shapes (a reduction of 864 or 1024
    values over 40 rows) across the threads, so their last bits depend on the thread count. That is
    torch's, not the team's: every run below starts from the same prefilled caches."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cache = model.make_cache(1, 64, KINDS[kind][1])
        prompt = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            model.hidden_states(prompt, cache=cache)
        return cache
    finally:
        torch.set_num_threads(before)


def _run(model: torch.nn.Module, prefilled: list, threads: int) -> list[torch.Tensor]:
    """From a copy of the prefilled caches, 4 one-token steps: the final hidden states, the layers' caches
    (and int8 scales); and 8 greedy tokens after a 9-token prompt (its prefill native: the multi-row
    products, each row with the bits of its one-row product)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        cache = copy.deepcopy(prefilled)
        prompt = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(1))
        tokens = torch.randint(0, 300, (4,), generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            hs = [model.hidden_states(t.view(1, 1), cache=cache)[0, 0] for t in tokens]  # (d,) each
            out = [torch.stack(hs), model.generate(prompt, 8)]
        for c in cache:
            out += [c.k[:, :, :44], c.v[:, :, :44]]
            if getattr(c, "k_scale", None) is not None:  # an int8 cache's scales
                out += [c.k_scale[:, :, :44], c.v_scale[:, :, :44]]
        return out
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("d", "n_heads", "n_kv_heads", "interleaved"), SHAPES)
def test_a_step_on_one_team_gives_the_bits_of_one_thread(d, n_heads, n_kv_heads, interleaved, kind):
    if kind == "fp16" and torch.float16 not in native.dtypes():
        pytest.skip("this build has no fp16 kernels (no F16C and no _Float16)")
    head_dim = d // n_heads
    assert (n_heads + 2 * n_kv_heads) * head_dim * d >= TEAM_MIN  # the team's case, not the one-thread one
    model = _model(d, n_heads, n_kv_heads, interleaved, kind)
    prefilled = _prefilled(model, kind)
    one = _run(model, prefilled, 1)
    for threads in (2, 3):  # 3 on a 2-core machine: more threads than cores, the same bits
        got = _run(model, prefilled, threads)
        assert all(torch.equal(a, b) for a, b in zip(one, got, strict=True)), f"{threads} threads"
