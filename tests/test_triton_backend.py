"""The ``triton`` backend's kernels against the float64 reference, forward and backward.

They run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, which must be set before Triton is first
imported: ``test_triton_plan.py`` runs this file in a subprocess with it) or on a CUDA GPU. Sizes are
small (the interpreter is slow) and the blocks of the interpreter (32 x 16 forward, 16 x 32 / 16 x 16
backward) make every length here span several tiles, full, partial, edge and empty ones.
"""

from __future__ import annotations

import os

import pytest
import torch

import multihead as mh
from multihead.backends import registry
from multihead.core.biases import as_bias
from tests.numerics import allowed, max_err

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not (INTERPRET or CUDA) or "triton" not in registry.names(),
    reason="needs Triton with CUDA, or TRITON_INTERPRET=1 set before the process starts (test_triton_plan.py "
    "runs this file in such a subprocess)",
)
DEVICE = "cpu" if INTERPRET else "cuda"
f64 = torch.float64


def _inputs(B, Hq, Hkv, Nq, Nk, D, Dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    shapes = [(B, Hq, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv), (B, Hq, Nq, Dv), (B, Hq, Nq)]
    return [torch.randn(*s, generator=g, dtype=f64) for s in shapes]


def _run(backend, dtype, q, k, v, dout, dlse, *, sinks=None, grad=True, **kw):
    """out, lse and (with grad) the gradients of q, k, v (and sinks) for <out, dout> + <lse, dlse>."""
    leaves = [t.to(DEVICE, dtype).detach().clone().requires_grad_(grad) for t in (q, k, v)]
    s = None
    if sinks is not None:
        s = sinks.to(DEVICE, f64 if dtype == f64 else torch.float32).detach().clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        res = mh.attention(*leaves, sinks=s, backend=backend, return_lse=True, **kw)
    outs = [res.out, res.lse]
    if grad:
        torch.autograd.backward([res.out, res.lse], [dout.to(DEVICE, dtype), dlse.to(DEVICE, res.lse.dtype)])
        outs += [t.grad for t in leaves] + ([s.grad] if s is not None else [])
    return outs


def check(dtype, shape, *, grad=True, lse_grad=False, sinks=None, **kw):
    """The numerics rule of DESIGN.md for every output, lse and gradient (tests/numerics.py)."""
    q, k, v, dout, dlse = _inputs(*shape)
    dlse = dlse if lse_grad else torch.zeros_like(dlse)
    gold = _run("reference", f64, q, k, v, dout, dlse, sinks=sinks, grad=grad, **kw)
    base = _run("matrix", dtype, q, k, v, dout, dlse, sinks=sinks, grad=grad, **kw)
    ours = _run("triton", dtype, q, k, v, dout, dlse, sinks=sinks, grad=grad, **kw)
    names = ["out", "lse", "dq", "dk", "dv", "dsinks"]
    for i, (o, b, r) in enumerate(zip(ours, base, gold, strict=True)):
        r = r.to(o.device)
        finite = torch.isfinite(r)
        if names[i] == "dsinks":  # a -inf sink: the oracle's gradient is NaN there, ours 0 (it has no mass)
            assert bool(torch.isfinite(o).all())
        else:
            assert torch.equal(torch.isfinite(o), finite), f"{names[i]}: non-finite entries differ"
        o, b, r = o[finite], b.to(o.device)[finite], r[finite]
        err, limit = max_err(o, r), allowed(max_err(b, r), grad=i >= 2)
        assert err <= limit, f"{names[i]}: error {err:.2e} > allowed {limit:.2e} ({dtype})"
    return ours


# (B, Hq, Hkv, Nq, Nk, D[, Dv])
MASKS = [
    ("none", None, (1, 2, 2, 33, 33, 32)),
    ("causal", mh.causal(), (1, 4, 2, 70, 70, 32)),
    ("causal Nq<Nk", mh.causal(), (2, 4, 1, 19, 50, 16)),
    ("window", mh.sliding_window(9), (1, 2, 1, 64, 64, 16)),
    ("padding", mh.padding([20, 45]) & mh.causal(), (2, 2, 2, 45, 45, 16)),
    ("prefix_lm", mh.prefix_lm(10), (1, 2, 2, 41, 41, 32, 16)),
    ("custom by head", mh.custom(lambda b, h, q, k: (q - k) % (h + 2) != 1), (1, 2, 1, 35, 35, 16)),
    ("window | prefix", mh.sliding_window(6) | mh.prefix_lm(3), (1, 2, 2, 40, 40, 24)),
    ("~document", ~mh.document([0] * 12 + [1] * 20), (1, 2, 2, 32, 32, 16)),
]


@pytest.mark.parametrize("name,mask,shape", MASKS, ids=[m[0] for m in MASKS])
def test_masks_fp32(name, mask, shape):
    check(torch.float32, shape, mask=mask)


def test_documents_causal_bf16_per_batch_ids():
    ids = torch.tensor([[0] * 10 + [1] * 30 + [2] * 8, [0] * 25 + [1] * 23])  # (B, N)
    check(torch.bfloat16, (2, 4, 2, 48, 48, 32), mask=mh.document(ids) & mh.causal())


def test_causal_gqa_bf16_with_lse_gradient():
    check(torch.bfloat16, (1, 4, 2, 50, 50, 32), mask=mh.causal(), lse_grad=True)


def test_key_padding_fully_masked_rows_are_zero_with_zero_grads():
    real = torch.ones(2, 40, dtype=torch.bool)
    real[1] = False  # batch row 1 sees no key: output and gradients 0, never NaN
    real[0, 5:9] = False
    out, lse, dq, dk, dv = check(torch.float32, (2, 2, 2, 30, 40, 16), mask=mh.key_padding(real))
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(dq[1], torch.zeros_like(dq[1]))
    assert torch.equal(dk[1], torch.zeros_like(dk[1])) and torch.equal(dv[1], torch.zeros_like(dv[1]))
    assert bool((lse[1] == float("-inf")).all())


def test_causal_more_queries_than_keys_top_rows_empty():
    out, lse, dq, *_ = check(torch.float32, (1, 2, 1, 40, 23, 16), mask=mh.causal())
    assert bool((lse[:, :, :17] == float("-inf")).all())
    assert torch.equal(out[:, :, :17], torch.zeros_like(out[:, :, :17]))  # rows above the keys
    assert torch.equal(dq[:, :, :17], torch.zeros_like(dq[:, :, :17]))


def test_key_only_bias_broadcasts_with_zero_strides():
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(45, generator=g).to(DEVICE)  # (Nk,): one value per key, every row and head
    check(torch.float32, (2, 2, 2, 30, 45, 16), bias=bias, mask=mh.padding([45, 12]))


def test_no_query_rows():
    q, k, v, *_ = _inputs(1, 2, 2, 0, 9, 16)
    res = mh.attention(*(t.float().to(DEVICE) for t in (q, k, v)), backend="triton", return_lse=True)
    assert res.out.shape == (1, 2, 0, 16) and res.lse.shape == (1, 2, 0)


def test_tensor_mask_and_tensor_bias():
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(2, 1, 37, 45, generator=g) > 0.3  # (B, 1, Nq, Nk)
    bias = torch.randn(1, 2, 37, 45, generator=g, dtype=f64).float()  # (1, Hq, Nq, Nk)
    check(torch.float32, (2, 2, 1, 37, 45, 16), mask=keep.to(DEVICE), bias=bias.to(DEVICE))


BIASES = [
    ("alibi", mh.alibi(4), mh.causal()),
    ("softcap", mh.softcap(5.0), mh.sliding_window(20)),
    ("alibi then softcap", mh.alibi(4) + mh.softcap(4.0), mh.causal()),
    ("softcap then alibi", mh.softcap(4.0) + mh.alibi(4), None),
]


@pytest.mark.parametrize("name,bias,mask", BIASES, ids=[b[0] for b in BIASES])
def test_biases(name, bias, mask):
    check(torch.float32, (1, 4, 2, 39, 39, 16), bias=bias, mask=mask)


def test_softcap_bf16():
    check(torch.bfloat16, (1, 2, 1, 48, 48, 32), bias=mh.softcap(3.0), mask=mh.causal())


def _bias_grads(backend, dtype, shape, kind, bias64, mask):
    """out and the gradients of q, k and the bias tensor through ``backend`` (a fixed cotangent)."""
    q, k, v, dout, _ = _inputs(*shape)
    t = bias64.to(DEVICE, dtype).clone().requires_grad_(True)
    leaves = [x.to(DEVICE, dtype).clone().requires_grad_(True) for x in (q, k, v)]
    bias = {
        "tensor": t,
        "cap, then tensor": mh.softcap(2.0) + as_bias(t),
        "tensor, then cap": as_bias(t) + mh.softcap(2.0),
        "custom": mh.custom_bias(lambda b, h, qi, ki: 0.5 * t[..., qi, ki] if t.dim() == 2 else t),
    }[kind]
    out = mh.attention(*leaves, mask=mask, bias=bias, backend=backend)
    out.backward(dout.to(DEVICE, dtype))
    return [out, t.grad, leaves[0].grad, leaves[1].grad]


BIAS_GRADS = [  # (kind, bias shape, dtype, mask); (B, Hq, Hkv, Nq, Nk, D) = (2, 2, 1, 37, 45, 16)
    ("tensor", (37, 45), torch.float32, mh.causal()),
    ("tensor", (2, 37, 45), torch.float32, mh.sliding_window(9)),  # per head
    ("tensor", (45,), torch.float32, mh.padding([45, 20])),  # per key: every row and head adds into it
    ("tensor", (2, 1, 37, 1), torch.float32, None),  # per (batch, row): a softmax constant, gradient 0
    ("cap, then tensor", (37, 45), torch.float32, mh.causal()),
    ("tensor, then cap", (2, 37, 45), torch.float32, mh.causal()),
    ("custom", (37, 45), torch.float32, mh.sliding_window(12)),
    ("tensor", (2, 37, 45), torch.bfloat16, mh.causal()),
]


@pytest.mark.parametrize(
    "kind,bshape,dtype,mask", BIAS_GRADS, ids=[f"{b[0]} {b[1]} {str(b[2])[6:]}" for b in BIAS_GRADS]
)
def test_bias_gradients_reach_the_bias_tensor(kind, bshape, dtype, mask):
    """The bias's gradient (accumulated in the dQ kernel, summed over the dims it broadcasts over, before
    or after the soft-cap's derivative) against the float64 reference, under the numerics rule."""
    shape = (2, 2, 1, 37, 45, 16)
    bias64 = torch.randn(*bshape, generator=torch.Generator().manual_seed(len(bshape)), dtype=f64)
    gold = _bias_grads("reference", f64, shape, kind, bias64, mask)
    base = _bias_grads("matrix", dtype, shape, kind, bias64, mask)
    ours = _bias_grads("triton", dtype, shape, kind, bias64, mask)
    for name, o, b, r in zip(["out", "dbias", "dq", "dk"], ours, base, gold, strict=True):
        r = r.to(o.device)
        err, limit = max_err(o, r), allowed(max_err(b.to(o.device), r), grad=name != "out")
        assert err <= limit, f"{name}: error {err:.2e} > allowed {limit:.2e} ({dtype})"


def test_custom_bias_forward():
    def rel(b, h, q, k):
        return -0.1 * (q - k).abs().double() + 0.5 * h

    check(torch.float32, (2, 2, 2, 33, 40, 16), grad=False, bias=mh.custom_bias(rel), mask=mh.causal())


def test_sinks_fp32_and_bf16_with_fully_masked_rows():
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=f64)
    no_sink = torch.tensor([0.5, -float("inf"), 2.0, 0.0], dtype=f64)  # -inf: head 1 has no sink
    check(torch.float32, (1, 4, 2, 40, 24, 16), mask=mh.causal(), sinks=no_sink, lse_grad=True)
    check(torch.bfloat16, (1, 4, 1, 33, 33, 32), mask=mh.sliding_window(7), sinks=sinks)


def test_fp16_alibi_unequal_value_dim():
    check(torch.float16, (1, 2, 2, 36, 36, 32, 64), bias=mh.alibi(2), mask=mh.causal())


def test_non_contiguous_inputs_from_token_major_layout():
    q, k, v, *_ = _inputs(1, 2, 2, 33, 33, 16)
    qt = (
        q.transpose(1, 2).contiguous().transpose(1, 2).float().to(DEVICE)
    )  # (B, H, N, D) strides of (B, N, H, D)
    ref = mh.attention(q, k, v, mask=mh.causal(), backend="reference")
    out = mh.attention(qt, k.float().to(DEVICE), v.float().to(DEVICE), mask=mh.causal(), backend="triton")
    assert max_err(out.cpu(), ref) <= 1e-5


def test_new_masks_reuse_the_compiled_kernel():
    """A new window size, document layout or length changes only data: the forward kernel's compile key
    (constexpr arguments, tensor dtypes, pointers' alignment to 16 bytes, and the divisibility by 16 of
    the ints Triton specialises) stays the same. Lengths, offsets and the mask's and bias's strides are
    left unspecialised (Triton would otherwise compile again when one changes its divisibility by 16);
    the q/k/v/o strides are specialised (16-byte loads), and with a head dim that is a multiple of 16
    they stay divisible at every length."""
    import inspect

    from multihead.backends.triton import forward

    original = forward._forward_kernel
    listed = getattr(original, "kwargs", {}).get("do_not_specialize") or original.do_not_specialize
    unspecialised = {original.arg_names[a] if isinstance(a, int) else a for a in listed}  # names or indices
    keys = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
                aligned = tuple(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor))
                names = original.arg_names
                spec = tuple(
                    (a % 16 == 0, a == 1)
                    for i, a in enumerate(args)
                    if isinstance(a, int) and names[i] not in unspecialised
                )
                keys.append((dtypes, aligned, spec, tuple(sorted(kwargs.items()))))
                return original[grid](*args, **kwargs)

            return launch

    calls = [(mh.sliding_window(5), 33), (mh.sliding_window(9), 33), (mh.document([0] * 20 + [1] * 20), 33)]
    calls += [(mh.document([0] * 7 + [1] * 33), 33), (mh.causal(), 51)]
    forward._forward_kernel = Recorder()
    try:
        for mask, n in calls:
            q, k, v, *_ = _inputs(1, 2, 2, n, n + 7, 16)
            q, k, v = (t.to(DEVICE, torch.float32) for t in (q, k, v))
            mh.attention(q, k, v, mask=mask, backend="triton")
    finally:
        forward._forward_kernel = original
    assert len(keys) == len(calls) and len(set(keys)) == 1
    params = list(inspect.signature(original.fn).parameters.values())
    first = [p.name for p in params].index("sqb")  # the pointers come before it
    ints = {p.name for p in params[first:] if "constexpr" not in str(p.annotation)}
    tensor_strides = {f"s{t}{d}" for t in "qkvo" for d in "bhn"}  # sqb, sqh, sqn, skb, ...
    assert ints - tensor_strides == unspecialised


@pytest.mark.skipif(not CUDA, reason="counts compiled kernels: needs CUDA (the interpreter compiles nothing)")
def test_cuda_new_mask_adds_no_compiled_kernel():
    from multihead.backends.triton import forward

    q, k, v, *_ = _inputs(1, 4, 2, 300, 300, 64)
    q, k, v = (t.to("cuda", torch.bfloat16) for t in (q, k, v))
    mh.attention(q, k, v, mask=mh.sliding_window(64), backend="triton")
    dev = torch.cuda.current_device()
    before = len(forward._forward_kernel.device_caches[dev][0])
    mh.attention(q, k, v, mask=mh.sliding_window(100), backend="triton")
    mh.attention(q, k, v, mask=mh.document([0] * 100 + [1] * 200) & mh.causal(), backend="triton")
    mh.attention(q[:, :, :257], k[:, :, :290], v[:, :, :290], mask=mh.causal(), backend="triton")
    assert len(forward._forward_kernel.device_caches[dev][0]) == before


def test_auto_never_picks_triton_on_cpu():
    q, k, v, *_ = _inputs(1, 2, 2, 40, 40, 16)
    text = mh.explain(q.float(), k.float(), v.float(), mask=mh.sliding_window(8), bias=mh.softcap(5.0))
    assert "auto -> triton" not in text
    # without the interpreter (a CUDA machine) the backend's own reason comes first
    assert (
        "not triton: auto uses the Triton kernels on CUDA only" in text
        or "not triton: on the CPU the Triton kernels run only in Triton's interpreter" in text
    )


def test_sdpa_leaves_masks_and_biases_to_triton_where_it_serves():
    """The rule auto applies on CUDA (checked here on problems the registered kernel can serve)."""
    from multihead.backends.auto import sdpa_leaves_to_triton
    from multihead.core.problem import make_problem

    q, k, v, *_ = _inputs(1, 4, 2, 64, 64, 16)
    q, k, v = (t.to(DEVICE, torch.bfloat16) for t in (q, k, v))
    for kw in (
        dict(mask=mh.sliding_window(8)),
        dict(bias=mh.softcap(30.0)),
        dict(mask=mh.causal(), bias=mh.alibi(4)),
    ):
        assert "the triton kernel serves it" in sdpa_leaves_to_triton(make_problem(q, k, v, **kw))
    assert sdpa_leaves_to_triton(make_problem(q, k, v, mask=mh.causal())) is None  # flash serves it
    assert sdpa_leaves_to_triton(make_problem(q, k, v)) is None
    assert sdpa_leaves_to_triton(make_problem(q[:, :, :4], k, v, mask=mh.causal())) is None  # a decode step
    assert (
        sdpa_leaves_to_triton(make_problem(q, k, v, mask=mh.causal(), dropout_p=0.1)) is None
    )  # kernel can't


@pytest.mark.skipif(not CUDA, reason="auto's CUDA choices need CUDA tensors")
def test_auto_on_cuda_picks_triton_for_masks_and_sdpa_for_plain_causal():
    q, k, v, *_ = _inputs(1, 4, 2, 256, 256, 64)
    q, k, v = (t.to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v))
    assert "auto -> sdpa" in mh.explain(q, k, v, mask=mh.causal())
    for kw in (
        dict(mask=mh.sliding_window(64)),
        dict(bias=mh.softcap(30.0)),
        dict(mask=mh.causal(), bias=mh.alibi(4)),
    ):
        text = mh.explain(q, k, v, **kw)
        assert "auto -> triton" in text, text


def test_why_not_is_precise():
    q, k, v, *_ = _inputs(1, 2, 2, 20, 20, 16)
    q, k, v = q.float().to(DEVICE), k.float().to(DEVICE), v.float().to(DEVICE)
    backend = registry.get("triton")
    from multihead.core.problem import make_problem

    assert "dropout" in backend.why_not(make_problem(q, k, v, dropout_p=0.1))
    assert "weights" in backend.why_not(make_problem(q, k, v, return_weights=True))
    assert "float64" in backend.why_not(make_problem(q.double(), k.double(), v.double()))
    grad_bias = torch.zeros(1, 2, 20, 20, device=DEVICE, requires_grad=True)
    assert backend.why_not(make_problem(q, k, v, bias=grad_bias)) is None  # its gradient is computed
    chain = mh.alibi(2) + mh.softcap(3.0) + mh.custom_bias(lambda b, h, q, k: 0.0 * q)
    assert "both sides" in backend.why_not(make_problem(q, k, v, bias=chain))
    with pytest.raises(ValueError, match=r"backend 'triton' cannot serve this call: dropout_p=0\.1"):
        mh.attention(q, k, v, dropout_p=0.1, backend="triton")
