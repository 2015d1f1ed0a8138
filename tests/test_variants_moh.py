"""MixtureOfHeads: the head-skipping path equals the compute-everything path, costs less, and MoH with every
head selected is multi-head attention up to its gates."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import multihead as mh
from multihead.variants import MixtureOfHeads, moh
from multihead.variants.moh import load_balance, pack_rows
from tests.numerics import TOL, max_err

F64 = torch.float64
B, N, M, d, H = 2, 9, 6, 32, 8
D = d // H


def make(seed=0, **kw):
    torch.manual_seed(seed)
    m = MixtureOfHeads(d, H, **kw).double()
    with torch.no_grad():
        for p in m.router_routed.parameters():
            p.mul_(8.0)  # decisive routing: ties between routed heads would make top-k fragile
    return m


def both(m, *args, **kw):
    """The module's output with skip="always" and with skip="never" (same weights)."""
    outs = []
    for skip in ("always", "never"):
        m.skip = skip
        outs.append(m(*args, **kw))
    return outs


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, d, generator=g, dtype=F64), torch.randn(B, M, d, generator=g, dtype=F64)


CALLS = {
    "plain": {},
    "causal": {"mask": mh.causal()},
    "causal+padding": {"mask": mh.causal() & mh.padding([N, 5])},
    "document": {"mask": mh.document(torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2]))},
    "tensor-mask": {"mask": torch.rand(B, H, N, N, generator=torch.Generator().manual_seed(2)) > 0.3},
    "alibi": {"mask": mh.causal(), "bias": mh.alibi(H)},
    "tensor-bias": {"bias": torch.randn(1, H, N, N, generator=torch.Generator().manual_seed(3), dtype=F64)},
    "softcap": {"bias": mh.softcap(2.0)},
    "positions": {
        "mask": mh.causal(),
        "positions": torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 2, 3, 4, 5, 6]]),
    },
}


@pytest.mark.parametrize("call", list(CALLS))
def test_skipping_equals_computing_every_head(call):
    kw = dict(CALLS[call])
    rot = mh.RotaryEmbedding(D) if call in ("positions", "causal") else None
    m = make(n_kv_heads=4, n_shared=2, top_k=2, rotary=rot).eval()
    x, _ = data()
    fast, full = both(m, x, head_mask=torch.linspace(0.5, 1.5, H, dtype=F64), **kw)
    assert max_err(fast, full) < TOL[F64]


def test_skipping_equals_computing_every_head_for_cross_attention_and_cache():
    m = make(n_shared=4, top_k=1, rotary=mh.RotaryEmbedding(D)).eval()
    x, ctx = data(seed=4)
    fast, full = both(m, x, ctx, mask=mh.key_padding(torch.tensor([[True] * M, [True] * 3 + [False] * 3])))
    assert max_err(fast, full) < TOL[F64]
    m.skip = "always"
    cache = mh.KVCache(B, H, D, N, dtype=F64)
    steps = [m(x[:, :5], mask=mh.causal(), cache=cache)] + [
        m(x[:, t : t + 1], mask=mh.causal(), cache=cache) for t in range(5, N)
    ]
    m.skip = "never"
    assert max_err(torch.cat(steps, dim=1), m(x, mask=mh.causal())) < TOL[F64]


def test_packed_rows_in_chunks_drop_the_keys_the_mask_hides(monkeypatch):
    monkeypatch.setattr(moh, "PACKED_CHUNK", 2)  # several chunks, each with its own key prefix
    seen = []
    real = moh.MixtureOfHeads._attend
    monkeypatch.setattr(
        moh.MixtureOfHeads, "_attend", lambda self, q, k, *a: seen.append(k.shape[2]) or real(self, q, k, *a)
    )
    m = make(seed=11, n_shared=2, top_k=2, rotary=mh.RotaryEmbedding(D)).eval()
    x, _ = data(seed=12)
    for mask in (mh.causal(), mh.sliding_window(3) & mh.padding([N, 6]), mh.prefix_lm(4)):
        seen.clear()
        fast, full = both(m, x, mask=mask)
        assert max_err(fast, full) < TOL[F64]
        assert min(seen) < N, mask  # some chunk attended over a key prefix only
    seen.clear()
    fast, full = both(m, x, mask=mh.custom(lambda b, h, q, k: k <= q))  # no analytic tiles: all keys
    assert max_err(fast, full) < TOL[F64] and min(seen) == N


def test_skipping_trains_identically():
    m = make(n_shared=2, top_k=3, rotary=mh.RotaryEmbedding(D)).train()
    x, _ = data(seed=5)
    grads = []
    for skip in ("always", "never"):
        m.skip = skip
        m.zero_grad()
        (m(x, mask=mh.causal()).pow(2).sum() + m.aux_loss).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for name, g in grads[0].items():
        assert max_err(g, grads[1][name]) < 1e-9, name


def test_skipping_does_less_work():
    """Eval, 2 shared + 6 routed heads, top-1: the routed heads' query and attention FLOPs shrink."""
    torch.manual_seed(6)
    m = MixtureOfHeads(128, 8, n_shared=2, top_k=1, backend="matrix").eval()
    x = torch.randn(2, 256, 128)
    flops = {}
    with torch.no_grad():
        for skip in ("eval", "never"):
            m.skip = skip
            with FlopCounterMode(display=False) as fc:
                m(x, mask=mh.causal())
            flops[skip] = fc.get_total_flops()
    rows = pack_rows(m.route(x).chosen)[0].shape[-1]  # m: the most tokens any routed head serves
    assert rows < 256 * 0.5  # a balanced-enough random router: no head took half of the tokens
    assert flops["eval"] < 0.75 * flops["never"], flops


def test_all_heads_selected_is_multi_head_attention_up_to_the_gates():
    m = make(seed=7, n_shared=3, top_k=5).eval()  # 5 routed heads, all selected
    mha = mh.MultiHeadAttention(d, H).double().eval()
    mha.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith("router")})
    x, _ = data(seed=8)
    gates = m.route(x).gates  # (B, N, H), every entry > 0
    assert bool((gates > 0).all())
    hook = mha.o_proj.register_forward_pre_hook(lambda mod, args: (args[0] * gates.repeat_interleave(D, -1),))
    try:
        want = mha(x, mask=mh.causal())
    finally:
        hook.remove()
    for skip in ("always", "never"):
        m.skip = skip
        assert max_err(m(x, mask=mh.causal()), want) < TOL[F64]
    with torch.no_grad():  # silent routers: alpha = 1/2, uniform softmaxes -> MHA with a fixed head_mask
        for lin in (m.router_groups, m.router_shared, m.router_routed):
            lin.weight.zero_()
    head_mask = torch.tensor([0.5 / 3] * 3 + [0.5 / 5] * 5, dtype=F64)
    assert max_err(m(x, mask=mh.causal()), mha(x, mask=mh.causal(), head_mask=head_mask)) < TOL[F64]


def test_load_balance_loss_and_routing_equations():
    m = make(seed=9, n_shared=2, top_k=2, balance_weight=0.5)
    x, _ = data(seed=10)
    with torch.no_grad():
        r = m.route(x)
    assert r.chosen.sum(-1).eq(2).all()  # top-k per token
    assert torch.allclose(r.gates.sum(-1) <= 1.0, torch.ones(B, N, dtype=torch.bool))
    m(x)
    T = B * N
    f = [sum(bool(r.chosen[b, t, i]) for b in range(B) for t in range(N)) / T for i in range(H - 2)]
    P = [sum(float(r.probs[b, t, i]) for b in range(B) for t in range(N)) / T for i in range(H - 2)]
    want = sum(fi * pi for fi, pi in zip(f, P))
    assert abs(load_balance(r.chosen, r.probs).item() - want) < TOL[F64]
    assert abs(m.aux_loss.item() - 0.5 * want) < TOL[F64]


def test_pack_rows_lists_each_heads_tokens_in_order():
    chosen = torch.tensor([[[True, False], [False, True], [True, False]]])  # (1, 3 tokens, 2 heads)
    rows, valid = pack_rows(chosen)
    assert rows.shape == (1, 2, 2)
    assert rows[0, 0].tolist() == [0, 2] and valid[0, 0].tolist() == [True, True]
    assert rows[0, 1].tolist() == [1, 1] and valid[0, 1].tolist() == [True, False]  # padding repeats
