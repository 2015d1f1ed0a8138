"""Threads chosen by the work's size, ``--threads`` on the commands, the busy-machine hint."""

from __future__ import annotations

import json

import pytest
import torch

from multihead import pretrained, threads
from multihead.cli.main import build_parser, main


def test_small_work_runs_on_one_thread_and_large_work_on_every_core():
    assert threads.threads_for(0.0) == 1
    assert threads.threads_for(1e6, 2e6, ceiling=8) == 1  # a 0.5M-parameter decode step
    assert threads.threads_for(1e12, ceiling=8) == 8
    assert threads.threads_for(2.5 * threads.FLOPS_PER_THREAD, ceiling=8) == 2
    assert threads.threads_for(0.0, 3.5 * threads.BYTES_PER_THREAD, ceiling=8) == 3
    assert threads.threads_for(1e12) <= min(torch.get_num_threads(), threads.cores())
    with pytest.raises(ValueError, match=r"flops and nbytes must be >= 0, got -1\.0 and 0\.0"):
        threads.threads_for(-1.0)
    with pytest.raises(ValueError, match="ceiling must be >= 1 thread, got 0"):
        threads.threads_for(1.0, ceiling=0)


def test_limited_never_raises_the_count_and_restores_it():
    before = torch.get_num_threads()
    with threads.limited(1) as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with threads.limited(before + 5) as n:
        assert n == before and torch.get_num_threads() == before


def test_a_small_model_decodes_on_one_thread(monkeypatch):
    lm = pretrained.random_lm("llama-tiny", seed=0)
    seen: list[int] = []
    lm.lm_head.register_forward_hook(lambda *a: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "cores", lambda: 4)
    torch.set_num_threads(2)
    try:
        out = lm.generate(torch.tensor([[1, 2, 3]]), 4)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (1, 7) and seen == [1, 1, 1, 1]


def test_the_busy_hint_compares_the_load_with_the_cores(monkeypatch):
    monkeypatch.setattr(threads, "cores", lambda: 2)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    assert threads.busy_hint() is None
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (5.25, 1.0, 1.0))
    hint = threads.busy_hint(1)
    assert hint is not None and "load 5.2 on 2 cores" in hint and "running on 1 thread(s)" in hint
    assert "\n" not in hint


COMPUTING = ["generate", "train", "encode", "eval", "study", "bench", "approx", "heads", "heads-convert"]


@pytest.mark.parametrize("command", COMPUTING)
def test_every_computing_command_takes_threads(command, monkeypatch):
    monkeypatch.setattr(threads, "cores", lambda: 4)  # --threads goes up to the cores
    args = build_parser().parse_args([command, "--threads", "3"])
    assert args.threads == 3


def test_threads_applies_to_the_run_and_is_restored(capsys, monkeypatch):
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (99.0, 1.0, 1.0))
    before = torch.get_num_threads()
    assert main(["generate", "--threads", "1", "--max-new-tokens", "3", "--json"]) == 0
    assert torch.get_num_threads() == before
    out = capsys.readouterr()
    assert json.loads(out.out)["new_tokens"] == 3
    assert "busier than its cores (load 99.0" in out.err and "running on 1 thread(s)" in out.err
    assert main(["generate", "--threads", "0"]) == 2
    assert "expected an integer from 1 to" in capsys.readouterr().err


def test_a_small_training_run_steps_on_one_thread(monkeypatch):
    """`multihead train` on a 0.4M-parameter model took 33 s on a busy 2-core machine with every core
    and 4.6 s on one: the trainer's steps run on the threads its work size asks for."""
    from multihead.train import trainer

    seen: list[int] = []
    real = trainer._steps

    def steps(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "_steps", steps)
    monkeypatch.setattr(threads, "cores", lambda: 4)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cfg = trainer.TrainConfig(seq_len=16, n_pairs=2, vocab=64, steps=2, batch=4, eval_examples=8)
        trainer.train_mqar(cfg)
        assert torch.get_num_threads() == 2  # restored after the run
    finally:
        torch.set_num_threads(before)
    assert seen == [1]
