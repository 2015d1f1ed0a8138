"""``LMConfig``: the shape of a :class:`~multihead.models.lm.TransformerLM` in one object.

Every argument of the model's constructor except the attention factory (code, not data) is a field, with
the constructor's defaults (LLaMA's). ``TransformerLM(config)`` builds it, ``model.config`` is what it
was built from, and :meth:`LMConfig.to_dict` / :meth:`LMConfig.from_dict` are what a checkpoint stores and
reads back (JSON-ready: ints, floats, strings, bools, None).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..core.limits import check_fits

__all__ = ["LMConfig", "check_weights_fit", "config_of"]


@dataclass(frozen=True)
class LMConfig:
    """A decoder-only language model's shape; the fields are :class:`TransformerLM`'s arguments.

    Example::

        cfg = mh.LMConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, d_ff=1536, n_kv_heads=3)
        model = mh.TransformerLM(cfg)
        assert model.config == cfg
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    n_kv_heads: int | None = None
    max_len: int = 2048
    positions: str = "rotary"
    norm: str = "rmsnorm"
    norm_first: bool = True
    activation: str = "swiglu"
    bias: bool = False
    tie_embeddings: bool = True
    dropout: float = 0.0
    rope_base: float = 10000.0
    sliding_window: int | None = None
    norm_eps: float = 1e-5

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (what a checkpoint stores)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LMConfig:
        """The config stored by :meth:`to_dict`.

        Raises:
            ValueError: a key that is not a field, or a required field missing (both named).
        """
        if not isinstance(values, dict):
            raise ValueError(f"LMConfig.from_dict needs a dict, got {type(values).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"LMConfig has no fields {unknown}; its fields are {names}")
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [n for n in required if n not in values]
        if missing:
            raise ValueError(f"LMConfig.from_dict is missing the required fields {missing}")
        return cls(**values)


def check_weights_fit(vocab_size: int, d_model: int, n_layers: int, d_ff: Any, positions: int) -> None:
    """Raise before building anything when the model's weights cannot fit in the free memory: counted
    from below (the embedding, a position table of ``positions`` rows, and per layer the query and output
    projections and a two-matrix feed-forward), so a model that fits is never refused.

    Raises:
        ValueError: naming the sizes, the bytes and the fix.
    """
    if not isinstance(d_ff, int) or isinstance(d_ff, bool):
        return  # the feed-forward names its own bad argument
    elt = torch.empty(0).element_size()  # the default dtype the weights are built in
    count = (vocab_size + positions) * d_model + n_layers * (2 * d_model * d_model + 2 * d_model * d_ff)
    what = (
        f"TransformerLM(vocab_size={vocab_size}, d_model={d_model}, n_layers={n_layers}, d_ff={d_ff}"
        + (f", max_len={positions}" if positions else "")
        + f") has at least {count} weights, which"
    )
    check_fits(count * elt, what, "lower vocab_size, d_model, d_ff, n_layers or max_len")


def config_of(first: int | LMConfig, sizes: tuple[int | None, ...], options: dict[str, Any]) -> LMConfig:
    """The :class:`LMConfig` of ``TransformerLM(config)`` or of its keyword form.

    Raises:
        ValueError: a config together with sizes or options, missing sizes, or an unknown option.
    """
    if isinstance(first, LMConfig):
        given = [
            n for n, v in zip(("d_model", "n_layers", "n_heads", "d_ff"), sizes, strict=True) if v is not None
        ]
        if given or options:
            raise ValueError(
                f"TransformerLM(config) takes its shape from the config, got also {given + sorted(options)}; "
                "use dataclasses.replace(config, ...) to change a field"
            )
        return first
    if any(v is None for v in sizes):
        raise ValueError(
            "TransformerLM needs vocab_size, d_model, n_layers, n_heads and d_ff (or one LMConfig), got "
            f"{(first, *sizes)}"
        )
    fields = set(LMConfig.__dataclass_fields__)
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"TransformerLM has no options {unknown}; its options are {sorted(fields)}")
    return LMConfig(first, *sizes, **options)  # type: ignore[arg-type]
