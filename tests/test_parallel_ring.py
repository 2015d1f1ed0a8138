"""Ring attention on 2 and 4 local gloo processes equals single-process ``mh.attention``, fwd and bwd.

Each world size is one launch (spawning is the slow part): every rank builds the same global problem from
one seed, runs ``ring_attention`` on its shard, and compares output, dQ, dK, dV with the float64
``reference`` backend (and one float32 case with the float32 single-process path) on its own rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import multihead as mh
from multihead.parallel import CommError, launch, ring_attention, shard, shard_ranges, unshard

from .numerics import TOL, allowed, max_err

B, HQ, HKV, D = 2, 4, 2, 8


def _problem(n: int, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g, dtype=dtype) for h in (HQ, HKV, HKV))
    do = torch.randn(B, HQ, n, D, generator=g, dtype=dtype)
    return q, k, v, do


def _cases(n: int):
    g = torch.Generator().manual_seed(1)
    docs = torch.sort(torch.randint(0, 4, (n,), generator=g)).values
    return {
        "no mask": (None, None),
        "causal": (mh.causal(), None),
        "sliding window": (mh.sliding_window(5), None),
        "documents": (mh.document(docs) & mh.causal(), None),
        "alibi": (mh.causal(), mh.alibi(HQ)),
        "alibi + softcap, no mask": (None, mh.alibi(HQ) + mh.softcap(3.0)),
        "tensor mask and bias": (
            torch.rand(B, 1, n, n, generator=g) > 0.3,
            torch.randn(1, HQ, n, n, generator=g),
        ),
    }


def _compare(rank, world, layout, n, mask, bias, dtype=torch.float64, oracle="reference") -> float:
    """Max |ring - single process| over out, dq, dk, dv on this rank's rows."""
    q, k, v, do = _problem(n, dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = mh.attention(*leaves, mask=mask, bias=bias, backend=oracle)
    want = [ref, *torch.autograd.grad(ref, leaves, do)]
    local = [shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, mask=mask, bias=bias, layout=layout, timeout=30)
    assert isinstance(out, torch.Tensor)
    got = [out, *torch.autograd.grad(out, local, shard(do, layout=layout))]
    return max((a - shard(b.detach(), layout=layout)).abs().max().item() for a, b in zip(got, want))


def _compare_sinks(rank, world, layout, n, mask) -> float:
    """Ring with attention sinks vs the float64 reference: out, dq, dk, dv on this rank's rows and the
    sinks' gradient summed over the ranks (each rank holds its rows' share)."""
    q, k, v, do = _problem(n)
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = mh.attention(*leaves[:3], mask=mask, sinks=leaves[3], backend="reference")
    want = [ref, *torch.autograd.grad(ref, leaves, do)]
    local = [shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
    s = sinks.clone().requires_grad_()
    out = ring_attention(*local, mask=mask, layout=layout, timeout=30, sinks=s)
    assert isinstance(out, torch.Tensor)
    got = list(torch.autograd.grad(out, [*local, s], shard(do, layout=layout)))
    dist.all_reduce(got[3])  # the sinks' gradient: each rank's rows' share
    errs = [(a - shard(b.detach(), layout=layout)).abs().max().item() for a, b in zip([out, *got[:3]], want)]
    return max([*errs, (got[3] - want[4]).abs().max().item()])


def _bf16_ratio(rank: int, world: int, n: int) -> float:
    """Ring's bf16 error against gold over the error bf16 ``matrix`` may have (DESIGN.md): must be <= 1."""
    q, k, v, do = _problem(n)
    gold = _compare_outputs(q, k, v, do, "reference", None)
    plain = _compare_outputs(q, k, v, do, "matrix", torch.bfloat16)
    local = [shard(t.bfloat16(), layout="zigzag").requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, mask=mh.causal(), layout="zigzag", timeout=30)
    assert isinstance(out, torch.Tensor)
    got = [out, *torch.autograd.grad(out, local, shard(do.bfloat16(), layout="zigzag"))]
    worst = 0.0
    for i, (a, g, p) in enumerate(zip(got, gold, plain)):
        want = shard(g, layout="zigzag")
        base = max_err(shard(p, layout="zigzag"), want)
        worst = max(worst, max_err(a, want) / allowed(base, grad=i > 0))
    return worst


def _compare_outputs(q, k, v, do, backend, dtype):
    """out, dq, dk, dv of single-process causal attention (optionally cast to ``dtype`` first)."""
    leaves = [(t if dtype is None else t.to(dtype)).clone().requires_grad_() for t in (q, k, v)]
    out = mh.attention(*leaves, mask=mh.causal(), backend=backend)
    assert isinstance(out, torch.Tensor)
    grads = torch.autograd.grad(out, leaves, do if dtype is None else do.to(dtype))
    return [out.detach(), *grads]


def _errors(rank: int, world: int) -> dict[str, object]:
    """What a rank reports back for the ValueError cases (the message, or 'no error')."""
    out: dict[str, object] = {}
    q, k, v, _ = _problem(4 * world + 1)
    try:  # 4W + 1 positions cannot be zigzag-sharded
        ring_attention(q[:, :, : 2 + rank], k[:, :, : 2 + rank], v[:, :, : 2 + rank], layout="zigzag")
        out["zigzag uneven"] = "no error"
    except ValueError as e:
        out["zigzag uneven"] = str(e)
    d = D if rank == 0 else D + 2  # rank 1 has a different head dim
    try:
        ring_attention(*(torch.randn(B, h, 4, d) for h in (HQ, HKV, HKV)))
        out["ranks disagree"] = "no error"
    except ValueError as e:
        out["ranks disagree"] = str(e)
    try:
        bias = torch.zeros(1, HQ, 2 * world, 2 * world, requires_grad=True)
        ring_attention(*(torch.randn(B, h, 2, D) for h in (HQ, HKV, HKV)), bias=bias)
        out["bias grad"] = "no error"
    except ValueError as e:
        out["bias grad"] = str(e)
    return out


def _ring_worker(rank: int, world: int) -> dict[str, object]:
    res: dict[str, object] = {}
    n = 8 * world  # a few tiles' worth is not needed for exactness; 8 positions per rank
    for layout in ("contiguous", "zigzag"):
        for name, (mask, bias) in _cases(n).items():
            res[f"{layout} / {name}"] = _compare(rank, world, layout, n, mask, bias)
    res["float32 causal zigzag"] = _compare(
        rank, world, "zigzag", n, mh.causal(), None, torch.float32, "matrix"
    )
    uneven = 4 * world + 3  # contiguous shards of unequal length (torch.tensor_split's rule)
    res["uneven contiguous / causal + alibi"] = _compare(
        rank, world, "contiguous", uneven, mh.causal(), mh.alibi(HQ)
    )
    q, k, v, _ = _problem(n)
    ref = mh.attention(q, k, v, mask=mh.causal(), backend="reference", return_lse=True)
    got = ring_attention(
        *(shard(t, layout="zigzag") for t in (q, k, v)), mask=mh.causal(), layout="zigzag", return_lse=True
    )
    assert isinstance(ref, mh.AttentionOutput) and isinstance(got, mh.AttentionOutput)
    assert got.lse is not None and ref.lse is not None
    res["lse"] = (got.lse - shard(ref.lse, layout="zigzag")).abs().max().item()
    res["unshard round trip"] = max(
        (unshard(shard(t, layout=lay), layout=lay) - t).abs().max().item()
        for t, lay in ((q, "zigzag"), (q[:, :, : n - 1], "contiguous"))  # uneven shards come back too
    )
    res["bfloat16 causal zigzag"] = _bf16_ratio(rank, world, n)
    empty_rows = torch.rand(B, 1, n, n, generator=torch.Generator().manual_seed(6)) > 0.3
    empty_rows[:, :, ::3] = False  # every third query row sees no key: only its sink
    for layout in ("contiguous", "zigzag"):
        res[f"{layout} / sinks, causal"] = _compare_sinks(rank, world, layout, n, mh.causal())
        res[f"{layout} / sinks, empty rows"] = _compare_sinks(rank, world, layout, n, empty_rows)
    res.update(_errors(rank, world))
    return res


@pytest.fixture(scope="module", params=[2, 4], ids=["W=2", "W=4"])
def ring_results(request):
    world = request.param
    return world, launch(_ring_worker, world, timeout=240, op_timeout=60)


CASES = [f"{lay} / {name}" for lay in ("contiguous", "zigzag") for name in _cases(8)]
CASES += ["uneven contiguous / causal + alibi", "lse", "unshard round trip"]
CASES += [f"{lay} / sinks, {m}" for lay in ("contiguous", "zigzag") for m in ("causal", "empty rows")]


@pytest.mark.parametrize("case", CASES)
def test_ring_matches_single_process_float64(ring_results, case):
    world, ranks = ring_results
    errs = [r[case] for r in ranks]
    assert max(errs) < TOL[torch.float64], f"{case} on {world} ranks: {errs}"


def test_ring_matches_single_process_float32(ring_results):
    _, ranks = ring_results
    errs = [r["float32 causal zigzag"] for r in ranks]
    assert max(errs) < TOL[torch.float32], errs


def test_ring_bfloat16_within_the_numerics_rule(ring_results):
    _, ranks = ring_results
    ratios = [r["bfloat16 causal zigzag"] for r in ranks]
    assert max(ratios) <= 1.0, ratios


def test_zigzag_refuses_uneven_shards(ring_results):
    _, ranks = ring_results
    for r in ranks:
        assert "layout='zigzag' needs every rank to hold the same even number" in r["zigzag uneven"]


def test_ranks_with_different_shapes_are_refused(ring_results):
    _, ranks = ring_results
    for r in ranks:
        assert "same batch, heads, head dims and dtype on every rank" in r["ranks disagree"]


def test_grad_requiring_tensor_bias_is_refused(ring_results):
    _, ranks = ring_results
    for r in ranks:
        assert "bias tensor requires grad" in r["bias grad"]


# -- checks that need no process group ------------------------------------------------------------
def _qkv(n=4):
    return [torch.randn(B, h, n, D) for h in (HQ, HKV, HKV)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layout": "striped"}, r"layout must be one of \['contiguous', 'zigzag'\], got 'striped'"),
        ({"timeout": 0}, r"timeout must be a finite number of seconds > 0, got 0"),
        ({"backend": "sdpa"}, r"backend that returns the log-sum-exp .* got 'sdpa'"),
        ({"backend": "nope"}, r"got 'nope'"),
    ],
)
def test_bad_arguments_raise_before_any_communication(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ring_attention(*_qkv(), **kwargs)


def test_q_and_k_must_hold_the_same_positions():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"n=4 queries and 3 keys on this rank"):
        ring_attention(q, k[:, :, :3], v[:, :, :3])


def test_local_shapes_are_validated_like_attention():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"divisible by kv heads"):
        ring_attention(q[:, :3], k, v)


def test_without_a_process_group_it_says_how_to_start_one():
    with pytest.raises(RuntimeError, match=r"init_process_group.*torchrun --nproc-per-node N"):
        ring_attention(*_qkv())


@pytest.mark.parametrize(
    ("n", "world", "layout", "want"),
    [
        (10, 3, "contiguous", [[(0, 4)], [(4, 7)], [(7, 10)]]),
        (8, 2, "zigzag", [[(0, 2), (6, 8)], [(2, 4), (4, 6)]]),
    ],
)
def test_shard_ranges(n, world, layout, want):
    assert shard_ranges(n, world, layout) == want


def test_shard_ranges_zigzag_needs_a_multiple_of_2w():
    with pytest.raises(
        ValueError, match=r"sequence length \(10\) to be a multiple of 2 \* world_size \(4\); pad it to 12"
    ):
        shard_ranges(10, 2, "zigzag")


def test_comm_error_is_a_runtime_error():
    assert issubclass(CommError, RuntimeError)
