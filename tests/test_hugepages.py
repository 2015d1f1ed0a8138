"""Weights in 2 MiB pages (multihead.native.hugepages): values, views, ties and identities survive; the
models that decode natively hold their streamed weights there."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multihead as mh
from multihead.models import quant
from multihead.native import hugepages

pytestmark = pytest.mark.skipif(
    not hugepages.available(), reason="this platform has no MADV_HUGEPAGE (huge pages are Linux's)"
)
MB = 1 << 20


def test_moved_tensors_keep_values_views_identity_and_gradients():
    big = torch.randn(1024, 1024)  # 4 MiB
    view = big[3:7]  # a view sharing big's storage
    small = torch.randn(10)  # under min_bytes: stays
    param = nn.Parameter(torch.randn(1024, 1024).to(torch.bfloat16))  # 2 MiB
    want = [big.clone(), view.clone(), small.clone(), param.detach().clone()]
    small_ptr = small.data_ptr()
    moved = hugepages.move_to_huge_pages([big, view, small, param])
    assert moved == 4 * MB + 2 * MB
    for t, w in zip([big, view, small, param], want):
        assert torch.equal(t, w)
    assert small.data_ptr() == small_ptr
    assert big.untyped_storage().data_ptr() % hugepages.HUGE_PAGE == 0  # the arena's first storage
    assert view.data_ptr() == big[3:].data_ptr()  # still a view of big
    view.add_(1)
    assert torch.equal(big[3:7], want[1] + 1)
    assert isinstance(param, nn.Parameter) and param.requires_grad


def test_a_tie_stays_a_tie_after_the_move():
    lin = nn.Linear(1024, 2048, bias=False)
    emb = nn.Embedding(2048, 1024)
    emb.weight = lin.weight
    hugepages.move_to_huge_pages([lin.weight, emb.weight])
    assert emb.weight is lin.weight
    assert emb.weight.data_ptr() == lin.weight.data_ptr()


def test_tensors_off_the_cpu_are_refused():
    with pytest.raises(ValueError, match="CPU tensors"):
        hugepages.move_to_huge_pages([torch.empty(4 * MB, device="meta")])


def test_collapse_changes_no_address_or_value():
    t = torch.randn(3 * MB)  # 12 MiB: at least four whole 2 MiB pages inside
    want, ptr = t.clone(), t.data_ptr()
    done = hugepages.collapse([t, t[5:]])  # one storage, counted once
    assert t.data_ptr() == ptr and torch.equal(t, want)
    assert 0 <= done <= t.numel() * 4
    assert done % hugepages.HUGE_PAGE == 0


def _lm() -> mh.TransformerLM:
    torch.manual_seed(0)
    return mh.TransformerLM(4096, 512, 2, 8, 1408, n_kv_heads=2)  # LLaMA-shaped; a 8 MiB tied head


def test_native_quantized_weights_move_and_decode_the_same_tokens():
    lm = _lm().eval()
    q = quant.quantize(lm, weights="fp32", kv=None, kernel="native")
    head = q.lm_head.weight
    assert q.embed.weight is head  # the tie kept
    assert torch.equal(head, lm.lm_head.weight)
    assert head.untyped_storage().data_ptr() != lm.lm_head.weight.untyped_storage().data_ptr()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        assert torch.equal(q.generate(ids, 6), lm.generate(ids, 6))


def test_a_plain_model_keeps_its_storage_when_its_steps_run_natively():
    lm = _lm().eval()
    ptrs = [p.data_ptr() for p in lm.parameters()]
    want = [p.detach().clone() for p in lm.parameters()]
    with torch.inference_mode():
        lm.generate(torch.tensor([[1, 2, 3]]), 3)
    assert [p.data_ptr() for p in lm.parameters()] == ptrs
    assert all(torch.equal(p, w) for p, w in zip(lm.parameters(), want))
    if lm.why_not_native_steps is None:
        assert lm.__dict__["_native_hugepages"]  # each streamed storage asked for once


def test_the_next_generation_reads_a_weight_given_new_memory():
    lm = _lm().eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        lm.generate(ids, 3)  # builds and keeps the native step's plan
        w1 = lm.layers[0].ffn.w1
        w1.weight.data = w1.weight.data * 3  # new memory, new values
        got = lm.generate(ids, 4)
        lm.native_steps = False
        want = lm.generate(ids, 4)
    assert torch.equal(got, want)


def test_coverage_reads_each_storages_mapping_share_from_smaps(tmp_path):
    """A fake smaps: the tensor's mapping half in huge pages -> 0.5; a storage under ``min_bytes`` or an
    unreadable file -> None; storages shared by several tensors are counted once."""
    t = torch.zeros(1 << 20)  # 4 MiB
    ptr, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    lo, hi = ptr - 4096, ptr + n + 4096
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"{lo:x}-{hi:x} rw-p 00000000 00:00 0\nRss: 1 kB\nAnonHugePages: {(hi - lo) // 2 // 1024} kB\n"
        "7f0000000000-7f0000001000 r--p 00000000 00:00 0\nAnonHugePages: 0 kB\n"
    )
    assert hugepages.coverage([t, t[:10], t.view(2, -1)], smaps=str(smaps)) == pytest.approx(0.5, abs=1e-3)
    assert hugepages.coverage([t], min_bytes=n + 1, smaps=str(smaps)) is None
    assert hugepages.coverage([t], smaps=str(tmp_path / "missing")) is None
