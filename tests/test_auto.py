"""`auto` picks a backend that can serve the call, and `explain` says why the others were not taken."""

from __future__ import annotations

import torch

import multihead as mh
from multihead.backends import sdpa as sdpa_mod


def _qkv(Nq=16, Nk=16, dtype=torch.float32):
    return (
        torch.randn(1, 4, Nq, 8, dtype=dtype),
        torch.randn(1, 2, Nk, 8, dtype=dtype),
        torch.randn(1, 2, Nk, 8, dtype=dtype),
    )


def _chosen(text: str) -> str:
    line = next(line for line in text.splitlines() if line.startswith("auto -> "))
    return line.split("auto -> ")[1].split(":")[0]


def test_backends_lists_the_required_four():
    assert {"reference", "matrix", "sdpa", "tiled"} <= set(mh.backends())


def test_plain_causal_goes_to_sdpa_and_explains_the_rest():
    text = mh.explain(*_qkv(), mask=mh.causal())
    assert _chosen(text) == "sdpa"
    for other in ("reference", "matrix", "tiled"):
        assert f"not {other}:" in text


def test_weights_go_to_matrix():
    text = mh.explain(*_qkv(), return_weights=True)
    assert _chosen(text) == "matrix"
    assert "cannot return the attention weights" in text


def test_softcap_and_lse_avoid_sdpa():
    assert _chosen(mh.explain(*_qkv(), bias=mh.softcap(3.0))) == "tiled"
    text = mh.explain(*_qkv(), return_lse=True)
    assert _chosen(text) == "tiled" and "log-sum-exp" in text


def test_bias_in_bf16_avoids_sdpa():
    text = mh.explain(*_qkv(dtype=torch.bfloat16), bias=mh.alibi(4))
    assert _chosen(text) == "tiled" and "round the bias" in text


def test_large_dense_mask_goes_to_tiled(monkeypatch):
    monkeypatch.setattr(sdpa_mod, "MAX_MASK_BYTES", 100)
    text = mh.explain(*_qkv(), mask=mh.sliding_window(4))
    assert _chosen(text) == "tiled" and "materialised" in text


def test_auto_result_equals_its_choice():
    q, k, v = _qkv(Nq=7, Nk=19)
    for kw in ({"mask": mh.causal()}, {"bias": mh.softcap(2.0)}, {"mask": mh.document([0] * 9 + [1] * 10)}):
        name = _chosen(mh.explain(q, k, v, **kw))
        assert torch.equal(mh.attention(q, k, v, **kw), mh.attention(q, k, v, backend=name, **kw))


def test_explain_with_named_backend():
    text = mh.explain(*_qkv(), backend="tiled")
    assert "backend='tiled' requested" in text


def test_custom_bias_under_grad_avoids_tiled():
    """Gradients into a custom_bias closure flow through the dense paths, so auto does not pick tiled."""
    q, k, v = _qkv()
    table = torch.randn(4, 16, 16, requires_grad=True)
    bias = mh.custom_bias(lambda b, h, qi, ki: table[h, qi, ki])
    text = mh.explain(q, k, v, bias=mh.softcap(3.0) + bias)
    assert _chosen(text) == "matrix" and "custom_bias" in text
    out = mh.attention(q, k, v, bias=mh.softcap(3.0) + bias)
    (g,) = torch.autograd.grad(out.sum(), [table])
    assert g.abs().sum() > 0
    with torch.no_grad():
        assert _chosen(mh.explain(q, k, v, bias=mh.softcap(3.0) + bias)) == "tiled"
