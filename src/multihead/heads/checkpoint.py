"""Save a model changed by head surgery and load it back: ``model.safetensors`` (its state dict) and
``surgery.json`` (the base model and the list of changes), from which :func:`load_converted` rebuilds the
structure on the base before loading the weights.

Bases in ``surgery.json``: ``"all-MiniLM-L6-v2"`` (the bundled sentence encoder), ``{"hf": DIR}`` (a
LLaMA-family ``save_pretrained`` directory, read by ``mh.pretrained.load``; it must still be there to
load) or ``{"preset": NAME}`` (``mh.pretrained.random_lm(NAME)``). Steps (applied in order):

    {"to": "prune", "heads": {"0": [1, 2], ...}}     heads removed per layer
    {"to": "gqa", "n_kv_heads": 2}                   kv heads per layer
    {"to": "mla", "kv_rank": 128}                     latent width per layer
    {"to": "mla", "kv_rank": 64, "rope_dims": 8, "rope_select": "norm"}      a rotary model (partial RoPE;
                                                      the kept pairs are buffers in the weights)
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from ..models.lm import TransformerLM
from ..pretrained.sentence_encoder import SentenceEncoder, minilm
from .gqa import to_gqa
from .mla import to_mla
from .pruning import prune

__all__ = ["MINILM", "SURGERIES", "apply_surgery", "load_converted", "save_converted"]

#: The base of a converted MiniLM in surgery.json.
MINILM = "all-MiniLM-L6-v2"

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
        rope_select = str(step.get("rope_select", "norm"))
        return to_mla(
            model, int(step["kv_rank"]), step.get("rope_dims"), calibration, rope_select=rope_select
        )
    raise ValueError(f"unknown surgery step {step!r}; 'to' must be one of {list(SURGERIES)}")


def save_converted(
    model: nn.Module, steps: Sequence[dict[str, Any]], out: str | Path, *, base: str | dict[str, str] = MINILM
) -> Path:
    """Write ``model.safetensors`` and ``surgery.json`` into ``out`` (created); return the folder.

    ``base``: what the steps were applied to (see the module docstring); a ``{"hf": DIR}`` is stored
    as an absolute path."""
    from safetensors.torch import save_file

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    # a copy of each tensor: tied weights (embedding = head) would share memory, which safetensors refuses
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    if isinstance(base, dict) and "hf" in base:
        base = {"hf": str(Path(base["hf"]).resolve())}
    meta = {"base": base, "steps": list(steps)}
    (folder / "surgery.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return folder


def _base_model(base: Any) -> nn.Module:
    """The model a surgery.json's ``base`` names.

    Raises:
        ValueError: a base that is none of the three kinds.
    """
    from ..pretrained.loading import load_hf_dir, random_lm

    if base == MINILM:
        return minilm()
    if isinstance(base, dict) and "hf" in base:
        return load_hf_dir(base["hf"])
    if isinstance(base, dict) and "preset" in base:
        return random_lm(str(base["preset"]))
    raise ValueError(f"surgery.json base {base!r} is not {MINILM!r}, {{'hf': DIR}} or {{'preset': NAME}}")


def load_converted(path: str | Path) -> SentenceEncoder | TransformerLM:
    """The model saved by :func:`save_converted` in ``path``: a SentenceEncoder (MiniLM base) or a
    TransformerLM (LLaMA-family base), in eval mode.

    Raises:
        ValueError: a folder without surgery.json / model.safetensors, an unknown base, or weights that do
            not fit.
    """
    from safetensors.torch import load_file

    folder = Path(path)
    meta_file, weights = folder / "surgery.json", folder / "model.safetensors"
    if not meta_file.is_file() or not weights.is_file():
        raise ValueError(
            f"{folder} must hold surgery.json and model.safetensors (written by `multihead heads convert` "
            "or mh.heads.save_converted)"
        )
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    model = _base_model(meta.get("base", MINILM))
    for step in meta["steps"]:
        model = apply_surgery(model, step)
    try:
        model.load_state_dict(load_file(str(weights)), strict=True)
    except RuntimeError as e:
        raise ValueError(f"{weights} does not fit the structure surgery.json describes: {e}") from None
    assert isinstance(model, (SentenceEncoder, TransformerLM))
    return model.eval()
