"""multihead inside Hugging Face transformers models.

::

    import multihead.hf
    multihead.hf.register()                      # once per process
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="multihead")
    # or: model.set_attn_implementation("multihead")

Every attention layer of the model then runs through :func:`multihead.attention` (GQA without repeated
heads, Gemma 2 soft-capping, gpt-oss sinks, dropout in training), and the masks transformers composes
(causal, sliding window, padding, packed sequences, bidirectional) reach the kernels as predicates, not as
dense (B, 1, N, N) tensors, so the tiled kernel skips the tiles they empty. transformers is imported
only when :func:`register` runs (install the extra: ``pip install multihead[hf]``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .attention import make_attention_function
from .masks import HFMask, describe, mask_interface

__all__ = ["HFMask", "describe", "make_attention_function", "mask_interface", "register"]


def register(name: str = "multihead", *, backend: Any = "auto", approx: Any = None) -> Callable[..., Any]:
    """Register multihead's attention and mask functions with transformers under ``name``.

    Args:
        name: the ``attn_implementation`` string models then accept (``"multihead"``).
        backend: the :func:`multihead.attention` backend: ``"auto"`` (default), ``"tiled"``, ...
        approx: an approximation from :mod:`multihead.approx` (``mh.approx.TopK(64)``, ...) computed
            instead of exact attention, for studies; register it under its own name.

    Returns:
        The registered attention function; its ``calls`` attribute counts the attention calls made
        outside ``torch.compile``.

    Raises:
        ValueError: when ``name`` is empty or names one of transformers' own implementations, or both
            ``backend`` (other than "auto") and ``approx`` are given.
        ImportError: when transformers is not installed.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    builtin = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "paged_attention")
    if name in builtin:
        raise ValueError(f"name {name!r} is one of transformers' own implementations; choose another name")
    if approx is not None and backend != "auto":
        raise ValueError(
            f"give either backend={backend!r} or approx={approx!r}, not both: "
            "an approximation replaces the backend"
        )
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "multihead.hf.register needs transformers>=4.48; install it with `pip install multihead[hf]`"
        ) from e
    fn = make_attention_function(approx if approx is not None else backend)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, mask_interface)
    return fn
