"""Shared state under threads: the mask-keyed caches, the native kernels' one build per process, and
thread counts set per thread (property tests: random interleavings of keys and counts)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead import native, threads
from multihead.core.mask_keys import KeyedCache
from multihead.core.masks import MaskContext
from multihead.native import build

THREADS = 4


def _together(fn, n: int = THREADS) -> list:
    """Run ``fn(i)`` on ``n`` threads released at once; their results, or the first exception raised."""
    start = threading.Barrier(n)
    results: list = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = fn(i)
        except BaseException as e:  # re-raised below, on the test's thread
            errors.append(e)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return results


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 3),
    st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=40), min_size=THREADS, max_size=THREADS),
)
def test_keyed_cache_serves_the_right_object_to_every_thread(maxsize, windows_per_thread):
    cache: KeyedCache[tuple[str, int]] = KeyedCache(maxsize)
    ctx = MaskContext(1, 1, 8, 8)

    def use(i: int) -> int:
        for w in windows_per_thread[i]:
            got = cache.get(mh.sliding_window(w), ctx, "cpu", lambda w=w: ("window", w))
            assert got == ("window", w)
            assert len(cache) <= maxsize
        return len(windows_per_thread[i])

    assert sum(_together(use)) == sum(map(len, windows_per_thread))
    assert len(cache) <= maxsize


def test_threads_missing_on_one_key_together_build_it_once():
    cache: KeyedCache[object] = KeyedCache(4)
    ctx = MaskContext(1, 1, 8, 8)
    release = threading.Event()

    def slow_build() -> object:
        release.wait(timeout=5)  # the other threads arrive while this build runs
        return object()

    def use(i: int) -> object:
        if i == 0:
            threading.Timer(0.2, release.set).start()
        return cache.get(mh.causal(), ctx, "cpu", slow_build)

    got = _together(use)
    assert cache.builds == 1 and all(g is got[0] for g in got)


def test_once_computes_its_value_once_under_threads():
    calls: list[int] = []
    gate = threading.Event()

    def compute() -> int:
        calls.append(1)
        gate.wait(timeout=5)
        return 42

    once = build.Once(compute)
    threading.Timer(0.2, gate.set).start()
    assert _together(lambda i: once()) == [42] * THREADS
    assert calls == [1]
    once.cache_clear()
    gate.set()
    assert once() == 42 and calls == [1, 1]


def _fake_compiler(tmp_path: Path, body: str) -> Path:
    cc = tmp_path / "fake-cc"
    cc.write_text("#!/bin/sh\n" + body)
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    return cc


def test_four_threads_first_use_runs_the_compiler_once(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    # a compiler that "succeeds" without writing a library: each run leaves one line in `calls`
    cc = _fake_compiler(tmp_path, f'echo run >> "{calls}"\nsleep 0.3\n')
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    native.loader.load.cache_clear()
    try:
        reasons = _together(lambda i: native.unavailable())
    finally:
        native.loader.load.cache_clear()
    assert all(r is not None and "wrote an empty file" in r for r in reasons)
    assert len(set(reasons)) == 1
    assert calls.read_text().count("run") == 1  # one build for the four threads


def test_a_directory_planted_at_the_librarys_path_is_replaced_by_a_build(tmp_path, monkeypatch):
    cc = _fake_compiler(tmp_path, "exit 0\n")
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    where, _, _ = native.cache.private_dir(tmp_path / "cache")
    assert where is not None
    so = native.library_path(str(cc), where)
    (so / "inside").mkdir(parents=True)
    (so / "inside" / "file").write_text("x")
    os.symlink(tmp_path, so / "link")  # removed, not followed
    native.loader.load.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="is not a regular file; rebuilt"):
            reason = native.unavailable()
    finally:
        native.loader.load.cache_clear()
    assert reason is not None and "wrote an empty file" in reason  # the build ran in its place
    assert not os.path.lexists(so) and tmp_path.is_dir() and (tmp_path / "fake-cc").exists()


@settings(max_examples=20, deadline=None)
@given(st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=3), min_size=THREADS, max_size=THREADS))
def test_limited_scopes_on_many_threads_leave_every_count_as_it_was(nested_counts):
    before = torch.get_num_threads()

    def use(i: int) -> tuple[int, int]:
        mine = torch.get_num_threads()
        _nest(nested_counts[i], mine)
        return mine, torch.get_num_threads()

    results = _together(use)
    assert all(start == end for start, end in results)
    assert torch.get_num_threads() == before
    assert _together(lambda i: torch.get_num_threads(), 1) == [before]  # what a new thread starts with


def _nest(counts: list[int], ceiling: int) -> None:
    if not counts:
        return
    with threads.limited(counts[0]) as n:
        assert n == min(counts[0], ceiling) == torch.get_num_threads()
        _nest(counts[1:], n)


def test_the_tile_plan_cache_serves_threads_that_plan_many_masks_at_once():
    from multihead.backends.triton import plan as tplan
    from multihead.core.problem import make_problem

    q = torch.zeros(1, 1, 40, 16)
    problems = [make_problem(q, q, q, mask=mh.sliding_window(w)) for w in range(1, 3 * tplan.CACHE_SIZE)]
    tplan.clear_cache()

    def use(i: int) -> int:
        for p in problems[i::2] + problems:  # misses, hits and evictions interleaved across threads
            assert isinstance(tplan.plan_for(p, 16, 16), tplan.TilePlan)
        return len(tplan._CACHE)

    assert all(n <= tplan.CACHE_SIZE for n in _together(use))
    tplan.clear_cache()
