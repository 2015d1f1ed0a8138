"""Save a MiniLM changed by head surgery and load it back: ``model.safetensors`` (its state dict) and
``surgery.json`` (the list of changes), from which :func:`load_converted` rebuilds the structure on the
bundled all-MiniLM-L6-v2 before loading the weights.

Steps in ``surgery.json`` (applied in order):

    {"to": "prune", "heads": {"0": [1, 2], ...}}     heads removed per layer
    {"to": "gqa", "n_kv_heads": 2}                   kv heads per layer
    {"to": "mla", "kv_rank": 128}                     latent width per layer
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from ..pretrained.sentence_encoder import SentenceEncoder, minilm
from .gqa import to_gqa
from .mla import to_mla
from .pruning import prune

__all__ = ["SURGERIES", "apply_surgery", "load_converted", "save_converted"]

SURGERIES = ("prune", "gqa", "mla")


def apply_surgery(model: nn.Module, step: dict[str, Any], *, calibration: Any = None) -> nn.Module:
    """One step of ``surgery.json`` applied to a copy of ``model`` (GQA by mean-pooling when no
    calibration is given: the structure is what matters when weights are loaded afterwards).

    Raises:
        ValueError: an unknown step.
    """
    kind = step.get("to")
    if kind == "prune":
        return prune(copy.deepcopy(model), {int(k): list(v) for k, v in step["heads"].items()})
    if kind == "gqa":
        method = "mean" if calibration is None else "aligned"
        return to_gqa(copy.deepcopy(model), int(step["n_kv_heads"]), method, calibration=calibration)
    if kind == "mla":
        return to_mla(model, int(step["kv_rank"]), calibration=calibration)
    raise ValueError(f"unknown surgery step {step!r}; 'to' must be one of {list(SURGERIES)}")


def save_converted(model: SentenceEncoder, steps: Sequence[dict[str, Any]], out: str | Path) -> Path:
    """Write ``model.safetensors`` and ``surgery.json`` into ``out`` (created); return the folder."""
    from safetensors.torch import save_file

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    meta = {"base": "all-MiniLM-L6-v2", "steps": list(steps)}
    (folder / "surgery.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return folder


def load_converted(path: str | Path) -> SentenceEncoder:
    """The SentenceEncoder saved by :func:`save_converted` in ``path``.

    Raises:
        ValueError: a folder without surgery.json / model.safetensors, or weights that do not fit.
    """
    from safetensors.torch import load_file

    folder = Path(path)
    meta_file, weights = folder / "surgery.json", folder / "model.safetensors"
    if not meta_file.is_file() or not weights.is_file():
        raise ValueError(
            f"{folder} must hold surgery.json and model.safetensors (written by `multihead heads convert` "
            "or mh.heads.save_converted)"
        )
    model: nn.Module = minilm()
    for step in json.loads(meta_file.read_text(encoding="utf-8"))["steps"]:
        model = apply_surgery(model, step)
    try:
        model.load_state_dict(load_file(str(weights)), strict=True)
    except RuntimeError as e:
        raise ValueError(f"{weights} does not fit the structure surgery.json describes: {e}") from None
    assert isinstance(model, SentenceEncoder)
    return model.eval()
