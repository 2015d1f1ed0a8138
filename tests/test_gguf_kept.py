"""GGUF's blocks kept as read (mh.pretrained.from_gguf's default) and made by mh.quant.quantize(weights=
"q4_0" | "q4_1"): the same bytes as the file, the same model as the one built directly from the dequantized
weights (run through F.linear on the blocks' values), and close to it on the native kernels, whose only
change is the activations' rounding to int8."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import multihead as mh
from multihead import native
from multihead.models import gguf_linear
from multihead.models.gguf_linear import GGUFEmbedding, GGUFLinear
from multihead.pretrained.gguf_file import GGUFTensorInfo
from multihead.pretrained.gguf_kept import kept_names

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'multihead[lm]')")
from gguf import GGMLQuantizationType as T  # noqa: E402

from .gguf_files import write_gguf  # noqa: E402

REASON = native.unavailable()
KEPT = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K]


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(0))


def _no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block modules' F.linear path: the blocks' own values, activations unrounded."""
    monkeypatch.setattr(gguf_linear.native, "library", lambda: None)


@pytest.mark.parametrize("qtype", KEPT, ids=lambda t: t.name)
def test_kept_blocks_are_the_file_s_bytes_and_the_model_built_directly(tmp_path, qtype, monkeypatch):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    want = write_gguf(path, qtype)
    got = mh.pretrained.from_gguf(path)
    kinds = {type(m) for m in got.modules()}
    assert GGUFLinear in kinds and torch.nn.Linear not in kinds and isinstance(got.embed, GGUFEmbedding)
    assert got.lm_head.blocks is got.embed.blocks  # the tied head reads the table's blocks
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    assert torch.equal(got.layers[1].ffn.w2.blocks, raw["blk.1.ffn_down.weight"])  # no round trip
    assert torch.equal(got.embed.blocks, raw["token_embd.weight"])
    qkv = got.layers[0].self_attn.qkv_proj.blocks
    assert torch.equal(
        qkv[-raw["blk.0.attn_v.weight"].shape[0] :], raw["blk.0.attn_v.weight"]
    )  # v unpermuted
    ids = _ids(want.vocab_size)
    with torch.no_grad():
        native_logits = got(ids)
        _no_kernels(monkeypatch)
        plain = got(ids)  # q/k rows unpermuted, q|k|v fused, tied head: the model built directly
        torch.testing.assert_close(plain, want(ids), rtol=0, atol=1e-5)
    if REASON is None:  # the kernels round the activations to int8 per 32: close, not equal
        err = (native_logits - plain).abs().max() / plain.abs().max()
        assert 0 < err < 0.03, float(err)


def test_a_mixed_file_keeps_every_tensor_in_its_own_type_and_decodes_natively(tmp_path, monkeypatch):
    """A Q4_K_M-like file (Q4_K, with the attention output and the feed-forward's down projection in
    Q6_K and the token table in Q8_0): each linear holds its tensor's own blocks, the native layers take
    the mixed kinds, and the model is the one built directly from the dequantized weights."""
    path = tmp_path / "mixed.gguf"
    types = {"attn_output": T.Q6_K, "ffn_down": T.Q6_K, "token_embd": T.Q8_0}
    want = write_gguf(path, T.Q4_K, tensor_types=types)
    got = mh.pretrained.from_gguf(path)
    layer = got.layers[0]
    kinds = [m.kind for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.ffn.w1, layer.ffn.w2)]
    assert kinds == ["q4_k", "q6_k", "q4_k", "q6_k"] and got.embed.kind == got.lm_head.kind == "q8_0"
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in gguf.GGUFReader(str(path)).tensors}
    assert torch.equal(layer.ffn.w2.blocks, raw["blk.0.ffn_down.weight"])
    ids = _ids(want.vocab_size)
    if REASON is None:
        assert got.why_not_native_steps is None  # every projection in its own kind, one native call
        prompt, steps = ids[:1, :5], ids[0, 5:11]
        with torch.no_grad():
            fast = got.make_cache(1, 16)
            got.hidden_states(prompt, cache=fast)
            native_rows = torch.cat([got.hidden_states(t.view(1, 1), cache=fast)[0] for t in steps])
            slow = copy.deepcopy(got)
            slow.native_steps = False  # the eager layers on the same blocks
            cache = slow.make_cache(1, 16)
            slow.hidden_states(prompt, cache=cache)
            eager_rows = torch.cat([slow.hidden_states(t.view(1, 1), cache=cache)[0] for t in steps])
        err = float((native_rows - eager_rows).abs().max() / eager_rows.abs().max())
        assert err < 1e-4, err  # the same products on the same rounded activations, another sum order
    with torch.no_grad():
        _no_kernels(monkeypatch)
        torch.testing.assert_close(got(ids), want(ids), rtol=0, atol=1e-5)


def test_a_mixed_q_k_v_triple_is_dequantized_and_said_why_not_native(tmp_path):
    path = tmp_path / "v6.gguf"
    write_gguf(path, T.Q4_K, tensor_types={"attn_v": T.Q6_K})
    got = mh.pretrained.from_gguf(path)
    assert type(got.layers[0].self_attn.qkv_proj) is torch.nn.Linear  # fused q | k | v: one type needed
    assert got.layers[0].ffn.w1.kind == "q4_k"
    if REASON is None:
        assert got.why_not_native_steps is not None  # a float qkv among block linears: the eager layers


def test_dequantize_true_keeps_today_s_fp32_model_and_quantize_reads_kept_blocks_back(tmp_path):
    path = tmp_path / "m.gguf"
    want = write_gguf(path, T.Q4_1)
    deq = mh.pretrained.from_gguf(path, dequantize=True)
    assert not any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in deq.modules())
    kept = mh.pretrained.from_gguf(path)
    q = mh.quant.quantize(kept, weights="fp32", kv=None)  # blocks read back to float first
    ids = _ids(want.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(q(ids), want(ids), rtol=0, atol=1e-4)
    cache = kept.make_cache(1, 8)  # a kept model makes fp32 dense caches without a float embedding
    assert cache[0].k.dtype == torch.float32


def test_a_q_k_v_triple_of_mixed_types_is_dequantized_whole():
    def info(name: str, kind: str) -> GGUFTensorInfo:
        return GGUFTensorInfo(name, kind, (64, 64), 0, 0)

    infos = [info("blk.0.attn_q.weight", "Q4_K"), info("blk.0.attn_k.weight", "Q4_K")]
    infos += [info("blk.0.attn_v.weight", "Q6_K"), info("blk.1.attn_q.weight", "Q4_1")]
    infos += [info("blk.1.attn_k.weight", "Q4_1"), info("blk.1.attn_v.weight", "Q8_0")]
    infos += [info("blk.2.attn_q.weight", "Q4_1"), info("blk.2.attn_k.weight", "Q4_1")]
    infos += [info("blk.2.attn_v.weight", "Q4_1"), info("blk.0.ffn_up.weight", "Q4_0")]
    infos += [GGUFTensorInfo("blk.0.attn_norm.weight", "F32", (64,), 0, 0)]
    assert kept_names(infos) == {f"blk.2.attn_{p}.weight" for p in "qkv"} | {"blk.0.ffn_up.weight"}


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_quantize_to_gguf_blocks_rounds_as_llama_cpp_and_generates(kind, monkeypatch):
    from gguf.quants import quantize as theirs

    torch.manual_seed(0)
    model = mh.TransformerLM(300, 128, 2, 4, 360, n_kv_heads=2).eval()
    q = mh.quant.quantize(model, weights=kind, kv=None)
    w1 = q.layers[0].ffn.w1
    assert isinstance(w1, GGUFLinear) and w1.kind == kind
    qtype = T[kind.upper()]
    assert torch.equal(
        w1.blocks, torch.from_numpy(theirs(model.layers[0].ffn.w1.weight.detach().numpy(), qtype))
    )
    assert q.embed.kind == q.lm_head.kind == "q8_0" and q.lm_head.blocks is q.embed.blocks
    assert type(q.layers[0].ffn.w2) is torch.nn.Linear  # 360 inputs: not a multiple of 32, kept float
    assert q.why_not_native_steps == "layer 0's w2 is a Linear, not a GGUFLinear"  # a float one left
    ids = _ids(300)
    with torch.no_grad():
        native_logits, ref = q(ids), model(ids)
        _no_kernels(monkeypatch)
        plain = q(ids)
    assert (plain - ref).abs().max() < 0.1 * ref.abs().max()  # 4-bit weights: near the float model
    if REASON is None:
        assert (native_logits - plain).abs().max() < 0.03 * plain.abs().max()
        assert not torch.equal(native_logits, plain)  # the native path ran (activations rounded)


def test_quantize_to_q4_k_falls_back_to_q4_1_where_a_width_is_not_256s_and_runs_natively(monkeypatch):
    torch.manual_seed(0)
    model = mh.TransformerLM(300, 288, 2, 4, 512, n_kv_heads=2).eval()  # 288 = 9 x 32, 512 = 2 x 256
    q = mh.quant.quantize(model, weights="q4_k", kv=None)
    layer = q.layers[0]
    assert (layer.ffn.w2.kind, layer.ffn.w1.kind, layer.self_attn.qkv_proj.kind) == ("q4_k", "q4_1", "q4_1")
    from multihead.native import gguf_blocks

    assert torch.equal(layer.ffn.w2.blocks, gguf_blocks.quantize(model.layers[0].ffn.w2.weight, "q4_k"))
    ids = _ids(300)
    with torch.no_grad():
        ref = model(ids)
        native_logits = q(ids)
        if REASON is None:
            assert q.why_not_native_steps is None
            out = q.generate(ids[:1, :6], 8, eos_token_id=[])  # native steps, mixed q4_k / q4_1 layers
            assert out.shape == (1, 14) and torch.equal(out[:, :6], ids[:1, :6])
        _no_kernels(monkeypatch)
        plain = q(ids)
        q41 = mh.quant.quantize(model, weights="q4_1", kv=None)(ids)  # the all-Q4_1 copy, as a yardstick
    assert (plain - ref).abs().max() <= 1.2 * (q41 - ref).abs().max()  # 4 bits a weight: as near as Q4_1
    if REASON is None:
        assert (native_logits - plain).abs().max() < 0.03 * plain.abs().max()


def test_quantize_refuses_other_kernels_and_group_sizes_for_blocks():
    model = mh.TransformerLM(64, 64, 1, 2, 128)
    with pytest.raises(
        ValueError, match=r"kernel for weights='q4_1' must be one of \['auto', 'native'\], got 'fbgemm'"
    ):
        mh.quant.quantize(model, weights="q4_1", kernel="fbgemm")
    with pytest.raises(ValueError, match="group_size=32"):
        mh.quant.quantize(model, weights="q4_0", group_size=32)
    with pytest.raises(ValueError, match="'q4_0', 'q4_1'"):
        mh.quant.quantize(model, weights="q4_2")
    with pytest.raises(ValueError, match="the block kind must be one of"):
        gguf_linear.quantize_blocks_(model, "q5_0")


@pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
@pytest.mark.parametrize(("kind", "threads"), [("q4_0", 1), ("q4_1", 2), ("q4_k", 2)])
def test_native_steps_of_blocks_follow_the_eager_steps_of_the_same_model(kind, threads, monkeypatch):
    """As the int8 rule (tests/test_native_int8.py): the native layers (one call a step, its products on
    the blocks, on a team of two threads too) against the eager layers of the same block model, both
    against the float model: the native steps' error at most twice the eager steps', the two apart by at
    most the eager steps' error; a prompt in one native call, a batch's step too."""
    import copy

    from multihead.models import native_step

    torch.manual_seed(1)
    d, f = (256, 512) if kind == "q4_k" else (128, 352)  # q4_k: widths of whole super-blocks
    lm = mh.TransformerLM(500, d, 2, 4, f, n_kv_heads=2).eval()
    fast = mh.quant.quantize(lm, weights=kind, kv=None)
    assert fast.why_not_native_steps is None
    slow = copy.deepcopy(fast)
    slow.native_steps = False  # the eager layers; their linears still run the native block product
    prompt = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, 500, (6,), generator=torch.Generator().manual_seed(3))
    calls: list[int] = []
    real = native_step.decode_step
    monkeypatch.setattr(native_step, "decode_step", lambda *a: calls.append(1) or real(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    hs = []
    try:
        with torch.no_grad():
            for model in (fast, slow, lm):
                cache = model.make_cache(1, 32)
                model.hidden_states(prompt, cache=cache)
                hs.append(torch.stack([model.hidden_states(t.view(1, 1), cache=cache)[0, 0] for t in tokens]))
                if model is slow:
                    assert len(calls) == 1 + 6  # the prompt in one native call, then the six steps
            batch = fast.make_cache(3, 8)
            rows = fast.hidden_states(tokens[:3].view(3, 1), cache=batch)  # (3, 1, d), one native call
            for b in range(3):
                one = fast.make_cache(1, 8)
                assert torch.equal(fast.hidden_states(tokens[b].view(1, 1), cache=one)[0], rows[b])
    finally:
        torch.set_num_threads(before)
    native_err, eager_err, apart = (
        float((a - b).abs().max()) for a, b in ((hs[0], hs[2]), (hs[1], hs[2]), (hs[0], hs[1]))
    )
    assert eager_err > 0  # the 4-bit model is not the float one
    assert native_err <= 2 * eager_err and apart <= eager_err, (native_err, eager_err, apart)


@pytest.mark.skipif(REASON is not None, reason=f"native kernels unavailable: {REASON}")
def test_native_greedy_runs_of_blocks_pick_the_tokens_of_the_step_by_step_path(monkeypatch):
    """The head's product on its Q8_0 blocks and the argmax inside the native run, the table's rows read
    back natively: the same kernels as the step-by-step path, so the same tokens."""
    from multihead.models import native_greedy

    torch.manual_seed(2)
    lm = mh.TransformerLM(500, 128, 2, 4, 352, n_kv_heads=2).eval()
    q = mh.quant.quantize(lm, weights="q4_1", kv=None)
    assert native_greedy.why_not_greedy(q) is None
    prompt = torch.randint(0, 500, (1, 7), generator=torch.Generator().manual_seed(4))
    runs: list[int] = []
    real = native_greedy.greedy_steps
    monkeypatch.setattr(native_greedy, "greedy_steps", lambda *a: runs.append(1) or real(*a))
    with torch.no_grad():
        fast = q.generate(prompt, 20, eos_token_id=[])
        assert runs  # the native greedy runs picked them
        monkeypatch.setattr(native_greedy, "why_not_greedy", lambda model: "step by step")
        slow = q.generate(prompt, 20, eos_token_id=[])
    assert torch.equal(fast, slow)
