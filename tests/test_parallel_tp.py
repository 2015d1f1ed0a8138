"""Tensor-parallel modules on 2 and 4 local gloo processes equal the single-process model (fp32, 1e-5 relative
to the larger of 1 and the largest value).

Each rank builds the model from one seed, keeps an unsharded copy, shards the other with
``tensor_parallel`` and compares outputs, input gradients and every parameter gradient: replicated and
DTensor (FFN) parameters against the full gradient, attention shards against this rank's rows / columns
of the full gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.parallel import launch, tensor_parallel

from .numerics import TOL


def _rows(m: mh.MultiHeadAttention, rank: int, world: int) -> torch.Tensor:
    """The rows of the full fused [q | k | v] projection that rank ``rank`` holds."""
    Hq, Hkv, D = m.n_heads, m.n_kv_heads, m.head_dim
    hq, hkv = Hq // world, Hkv // world
    return torch.cat(
        [
            torch.arange(rank * hq * D, (rank + 1) * hq * D),
            Hq * D + torch.arange(rank * hkv * D, (rank + 1) * hkv * D),
            (Hq + Hkv) * D + torch.arange(rank * hkv * D, (rank + 1) * hkv * D),
        ]
    )


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want|, relative to the larger of 1 and max |want| (fp32 rounding scales with magnitude:
    the gradients of sum(out^2) through a post-LN layer reach tens)."""
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def _grad_errors(tp: nn.Module, ref: nn.Module, rank: int, world: int) -> float:
    """Max error (:func:`_err`) of grad(tp) against the matching part of grad(ref) over every parameter."""
    worst = 0.0
    ref_params = dict(ref.named_parameters())
    attn = {n: m for n, m in ref.named_modules() if isinstance(m, mh.MultiHeadAttention)}
    for name, p in tp.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # DTensor (FFN) or local
        want = ref_params[name].grad
        owner, _, leaf = name.rpartition(".")
        mod_name = owner.rpartition(".")[0]
        if mod_name in attn and owner.endswith("qkv_proj"):
            want = want[_rows(attn[mod_name], rank, world)]
        elif mod_name in attn and owner.endswith("o_proj") and leaf == "weight":
            cols = want.shape[1] // world
            want = want[:, rank * cols : (rank + 1) * cols]
        elif owner in attn and leaf == "sinks":  # one sink per query head: this rank's heads
            hq = want.shape[0] // world
            want = want[rank * hq : (rank + 1) * hq]
        assert g is not None and g.shape == want.shape, (name, g, want.shape)
        worst = max(worst, _err(g, want))
    return worst


def _check(model: nn.Module, run, rank: int, world: int) -> dict[str, float]:
    """Run ``run(model) -> output`` on a copy and on the sharded model; errors of output and gradients."""
    ref = copy.deepcopy(model)
    want = run(ref)
    _loss(want).backward()
    tensor_parallel(model)
    got = run(model)
    _loss(got).backward()
    return {"out": _err(got, want), "grads": _grad_errors(model, ref, rank, world)}


def _x(*shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7))


def _loss(out: torch.Tensor) -> torch.Tensor:
    """sum(out * R) with a fixed random R. Not sum(out^2): after a post-LN layer that sum is nearly
    constant (LayerNorm fixes each row's norm), so its gradients are cancellation noise of ~1e-4 whose
    rounding error alone can exceed the tolerance."""
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(11))
    return (out * weights).sum()


def _tp_worker(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    res: dict[str, object] = {}
    h = 4 if world == 2 else 8
    x = _x(2, 9, 32)

    def input_grad(model, **kw):
        leaf = x.clone().requires_grad_()
        out = model(leaf, **kw)
        _loss(out).backward()
        return out, leaf.grad

    for name, kv, kw in (
        ("MHA causal", None, {"mask": mh.causal()}),
        ("GQA rotary causal", h // 2, {"mask": mh.causal()}),
        ("MHA alibi", None, {"bias": mh.alibi(h)}),
        ("GQA sinks causal", h // 2, {"mask": mh.causal()}),
    ):
        rot = mh.RotaryEmbedding(32 // h) if "rotary" in name else None
        m = mh.MultiHeadAttention(32, h, kv, rotary=rot, sinks="sinks" in name)
        if m.sinks is not None:
            nn.init.normal_(m.sinks)
        ref = copy.deepcopy(m)
        want_out, want_gx = input_grad(ref, **kw)
        tensor_parallel(m)
        got_out, got_gx = input_grad(m, **kw)
        res[name] = max(
            _err(got_out, want_out),
            _err(got_gx, want_gx),
            _grad_errors(m, ref, rank, world),
        )
    ctx = _x(2, 5, 32)
    cross = mh.MultiHeadAttention(32, h, h // 2)
    res["GQA cross-attention"] = max(_check(cross, lambda m: m(x, ctx), rank, world).values())
    for name, kw in (
        ("TransformerLayer post-LN relu", {}),
        (
            "TransformerLayer pre-LN swiglu rmsnorm",
            {"norm_first": True, "activation": "swiglu", "norm": "rmsnorm"},
        ),
    ):
        layer = mh.TransformerLayer(32, h, 64, n_kv_heads=h // 2, **kw)
        res[name] = max(_check(layer, lambda m: m(x, mask=mh.causal()), rank, world).values())
    lm = mh.TransformerLM(61, 32, 2, h, 64, n_kv_heads=h // 2)
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(3))
    prompt = ids[:, :4]
    want_ids = copy.deepcopy(lm).generate(prompt, 6)
    res["TransformerLM"] = max(_check(lm, lambda m: m(ids), rank, world).values())
    res["TransformerLM generate (KV cache of local heads)"] = float(
        not torch.equal(lm.generate(prompt, 6), want_ids)
    )
    res.update(_refusals(world))
    return res


def _refusals(world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    cases = {
        "heads": lambda: mh.MultiHeadAttention(24, 2 * world + 2 if world == 2 else 6, 1),
        "dropout": lambda: mh.TransformerLayer(32, 4, 64, dropout=0.1),
        "nothing to shard": lambda: nn.Linear(4, 4),
    }
    for name, make in cases.items():
        try:
            tensor_parallel(make())
            out[f"refuses {name}"] = "no error"
        except ValueError as e:
            out[f"refuses {name}"] = str(e)
    m = tensor_parallel(mh.MultiHeadAttention(32, 4, 2 if world == 2 else 4))
    try:
        tensor_parallel(m)
        out["refuses twice"] = "no error"
    except ValueError as e:
        out["refuses twice"] = str(e)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["W=2", "W=4"])
def tp_results(request):
    world = request.param
    return world, launch(_tp_worker, world, timeout=240, op_timeout=60)


MODELS = [
    "MHA causal",
    "GQA rotary causal",
    "MHA alibi",
    "GQA sinks causal",
    "GQA cross-attention",
    "TransformerLayer post-LN relu",
    "TransformerLayer pre-LN swiglu rmsnorm",
    "TransformerLM",
    "TransformerLM generate (KV cache of local heads)",
]


@pytest.mark.parametrize("case", MODELS)
def test_tensor_parallel_matches_single_process(tp_results, case):
    world, ranks = tp_results
    errs = [r[case] for r in ranks]
    assert max(errs) < TOL[torch.float32], f"{case} on {world} ranks: {errs}"


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("refuses heads", "must both be divisible by the world size"),
        ("refuses dropout", "tensor_parallel needs dropout=0"),
        ("refuses nothing to shard", "holds no MultiHeadAttention or FeedForward to shard"),
        ("refuses twice", "already tensor-parallel"),
    ],
)
def test_tensor_parallel_refusals(tp_results, case, match):
    _, ranks = tp_results
    for r in ranks:
        assert match in r[case], r[case]


def test_tensor_parallel_needs_a_process_group():
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialised"):
        tensor_parallel(mh.MultiHeadAttention(16, 2))
