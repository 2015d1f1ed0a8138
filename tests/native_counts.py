"""Counting the decode steps that ran natively, one at a time or inside a native greedy run."""

from __future__ import annotations

import pytest

from multihead.models import native_greedy, native_step


def count_native_steps(monkeypatch: pytest.MonkeyPatch, prompts: list[int] | None = None) -> list[int]:
    """A list that grows by one for every native one-token decode step from now on: each
    :func:`~multihead.models.native_step.decode_step` call of one token a row, and each step a
    :func:`~multihead.models.native_greedy.greedy_steps` run took (its caches' advance). ``prompts``, if
    given, grows by the token count of each native call of several tokens of one row (a prompt)."""
    steps: list[int] = []
    one, run = native_step.decode_step, native_greedy.greedy_steps

    def counted_step(model, ids, cache):
        if ids.shape[1] == 1:
            steps.append(1)
        elif prompts is not None:
            prompts.append(ids.shape[1])
        return one(model, ids, cache)

    def counted_run(model, h, out, t, n, last, eos, cache):
        before = cache[0].position
        got = run(model, h, out, t, n, last, eos, cache)
        steps.extend([1] * (cache[0].position - before))
        return got

    monkeypatch.setattr(native_step, "decode_step", counted_step)
    monkeypatch.setattr(native_greedy, "greedy_steps", counted_run)
    return steps
