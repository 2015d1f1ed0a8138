"""The library changes nothing process-wide that its caller did not ask for: torch's global random
generator and its thread count."""

from __future__ import annotations

import threading

import pytest
import torch

import multihead as mh
from multihead import rng, threads


@pytest.fixture
def two_threads(monkeypatch):
    """torch on 2 threads (restored after), on a machine said to have 4 cores."""
    monkeypatch.setattr(threads, "cores", lambda: 4)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_random_lm_leaves_the_global_generator_as_it_was():
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    lm = mh.pretrained.random_lm("llama-tiny", seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    again = mh.pretrained.random_lm("llama-tiny", seed=0)  # the seed still fixes the weights
    assert all(torch.equal(a, b) for a, b in zip(lm.state_dict().values(), again.state_dict().values()))
    other = mh.pretrained.random_lm("llama-tiny", seed=1)
    assert not torch.equal(lm.embed.weight, other.embed.weight)


def test_loading_a_converted_preset_leaves_the_global_generator_as_it_was(tmp_path):
    base = mh.pretrained.random_lm("llama-tiny", seed=0)
    steps = [{"to": "gqa", "n_kv_heads": 1}]
    lm = mh.heads.apply_surgery(base, steps[0])
    mh.heads.save_converted(lm, steps, tmp_path / "out", base={"preset": "llama-tiny"})
    torch.manual_seed(99)
    state = torch.get_rng_state()
    mh.pretrained.load(tmp_path / "out")
    assert torch.equal(torch.get_rng_state(), state)


def test_design_costs_leave_the_global_generator_as_it_was():
    torch.manual_seed(7)
    state = torch.get_rng_state()
    mh.cost.design_costs(d_model=32, n_heads=4, context=8, names=["mha", "gqa"])
    assert torch.equal(torch.get_rng_state(), state)


def test_private_draws_match_a_seeded_global_generator_and_other_threads_keep_theirs():
    torch.manual_seed(5)
    want = (torch.randn(3), torch.empty(4).uniform_(), torch.nn.init.normal_(torch.empty(2)))
    torch.manual_seed(42)
    state = torch.get_rng_state()
    drawn: list[torch.Tensor] = []
    with rng.private(5):
        worker = threading.Thread(target=lambda: drawn.append(torch.randn(3)))
        worker.start()
        worker.join()
        got = (torch.randn(3), torch.empty(4).uniform_(), torch.nn.init.normal_(torch.empty(2)))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.set_rng_state(state)
    assert torch.equal(drawn[0], torch.randn(3))  # the other thread drew from the global generator
    with pytest.raises(ValueError, match=r"seed must be an int >= 0, got -1"), rng.private(-1):
        pass


def test_limited_applies_to_the_calling_thread_alone(two_threads):
    seen: dict[str, int] = {}

    def started_meanwhile():
        seen["new thread"] = torch.get_num_threads()

    with threads.limited(1) as n:
        seen["inside"] = torch.get_num_threads()
        t = threading.Thread(target=started_meanwhile)
        t.start()
        t.join()
    assert n == 1 and seen == {"inside": 1, "new thread": 2}
    assert torch.get_num_threads() == 2


def test_a_thread_started_during_generate_runs_on_the_process_count(two_threads):
    lm = mh.pretrained.random_lm("llama-tiny", seed=0)
    seen: list[int] = []
    inside: list[int] = []

    def hook(*_):
        inside.append(torch.get_num_threads())
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()

    lm.lm_head.register_forward_hook(hook)
    lm.generate(torch.tensor([[1, 2, 3]]), 3)
    assert inside == [1, 1, 1] and seen == [2, 2, 2]
    assert torch.get_num_threads() == 2


def test_a_hosts_set_num_threads_during_generate_is_not_undone(two_threads):
    lm = mh.pretrained.random_lm("llama-tiny", seed=0)
    lm.lm_head.register_forward_hook(lambda *_: torch.set_num_threads(1))  # the host, mid-run
    lm.generate(torch.tensor([[1, 2, 3]]), 2)
    assert torch.get_num_threads() == 1
    after: list[int] = []
    t = threading.Thread(target=lambda: after.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert after == [1]


def test_a_hosts_set_num_threads_from_another_thread_during_generate_stays(two_threads):
    lm = mh.pretrained.random_lm("llama-tiny", seed=0)
    changed = threading.Event()

    def host():
        torch.set_num_threads(1)
        changed.set()

    def hook(*_):
        if not changed.is_set():
            threading.Thread(target=host).start()
            changed.wait()

    lm.lm_head.register_forward_hook(hook)
    lm.generate(torch.tensor([[1, 2, 3]]), 2)
    assert torch.get_num_threads() == 1  # what a new thread starts with, and this one now
