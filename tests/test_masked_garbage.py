"""Keys and values a mask hides from every query never influence the output or the gradients, on every
backend: NaN, +-Inf and 1e30 in the pad slots give exactly the clean run's results (forward and backward)."""

from __future__ import annotations

import pytest
import torch

import multihead as mh

B, HQ, HKV, NK, D = 2, 4, 2, 80, 8
LENGTHS = [53, 17]  # real keys per batch row; the rest are pad slots
REAL = torch.arange(NK)[None] < torch.tensor(LENGTHS)[:, None]  # (B, Nk)

MASKS = {
    "padding": lambda: mh.padding(LENGTHS),
    "key_padding": lambda: mh.key_padding(REAL),
    "bool tensor (B, 1, 1, Nk)": lambda: REAL[:, None, None, :],
    "bool tensor per query head": lambda: REAL[:, None, None, :].expand(B, HQ, 1, NK).clone(),
    "causal & padding": lambda: mh.causal() & mh.padding(LENGTHS),
    "sliding window & key_padding": lambda: mh.sliding_window(24) & mh.key_padding(REAL),
    "left padding as a bool tensor": lambda: REAL.flip(-1)[:, None, None, :],
}
NAN, INF = float("nan"), float("inf")
#: (what the hidden keys hold, what the hidden values hold)
GARBAGE = {"NaN / Inf": (NAN, INF), "-Inf / NaN": (-INF, NAN), "1e30 / -1e30": (1e30, -1e30)}


def _cases():
    for backend in mh.backends():
        for nq in (4, 64):
            if backend == "decode" and nq > 16:
                continue  # decode serves decode steps only; tiled serves this call under auto
            yield backend, nq


def _run(q, k, v, mask, backend):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = mh.attention(q, k, v, mask=mask, backend=backend)
    out.backward(torch.ones_like(out))
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("backend, nq", list(_cases()))
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_garbage_in_hidden_keys_changes_nothing(backend, nq, mask_name):
    torch.manual_seed(0)
    q, k, v = torch.randn(B, HQ, nq, D), torch.randn(B, HKV, NK, D), torch.randn(B, HKV, NK, D)
    mask = MASKS[mask_name]()
    pad = (~REAL.flip(-1) if "left" in mask_name else ~REAL)[:, None, :, None]  # (B, 1, Nk, 1)
    clean = _run(q, k, v, mask, backend)
    for name, (in_k, in_v) in GARBAGE.items():
        dirty = _run(q, k.masked_fill(pad, in_k), v.masked_fill(pad, in_v), mask, backend)
        for what, a, b in zip(("out", "dq", "dk", "dv"), clean, dirty):
            assert torch.isfinite(b).all(), f"{backend}, {mask_name}, {name}: non-finite {what}"
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=f"{backend} {mask_name} {name} {what}")


def test_a_mask_that_hides_nothing_costs_no_copy():
    from multihead.core.dead_keys import clear_dead_keys
    from multihead.core.problem import make_problem

    q = torch.randn(1, 2, 4, 8)
    for mask in (None, mh.causal(), mh.padding([4]), mh.sliding_window(2)):
        p = make_problem(q, q, q, mask=mask)
        assert clear_dead_keys(p) is p
    p = make_problem(q, q, q, mask=mh.padding([3]))
    cleared = clear_dead_keys(p)
    assert cleared is not p and bool((cleared.k[:, :, 3] == 0).all())
